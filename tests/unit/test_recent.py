"""The last-minute window behind /v1/stats, driven by a fake clock."""

from serve_app.core.recent import RecentEvents, mean, percentile


def test_window_drops_events_older_than_its_horizon():
    window = RecentEvents(horizon_s=60)
    for t in range(0, 100, 10):
        window.add(t * 1.0, now=float(t))
    assert [e[1] for e in window.recent(now=95.0)] == [40.0, 50.0, 60.0, 70.0, 80.0, 90.0]
    assert window.covered_s(now=95.0) == 60


def test_window_is_bounded_and_says_how_much_it_covers():
    window = RecentEvents(horizon_s=60, max_events=5)
    for t in range(10):
        window.add("x", now=float(t))
    assert len(window.recent(now=10.0)) == 5
    assert window.covered_s(now=10.0) == 5.0  # a burst filled it: it covers 5 s, not 60


def test_percentile_and_mean():
    assert percentile([], 95) is None and mean([]) is None
    values = list(range(1, 101))
    assert percentile(values, 50) == 50 and percentile(values, 95) == 95 and percentile(values, 100) == 100
    assert percentile([3.0], 99) == 3.0 and mean([1, 2, 3]) == 2

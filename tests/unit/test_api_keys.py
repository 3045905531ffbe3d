"""API keys: roles, 401 vs 403, sources, and refusing to start without keys."""

import pytest

from serve_app.ingress.auth import ApiKeys, Role, read_keys
from serve_app.core.errors import AuthenticationError, PermissionDeniedError

USER, ADMIN = "user-key-0123456789abcdef", "admin-key-0123456789abcdef"


@pytest.fixture
def keys(tmp_path):
    admin_file = tmp_path / "admin.keys"
    admin_file.write_text(f"# rotated 2026-11\n{ADMIN}\n\n")
    return ApiKeys.load(user_env="KEYS", user_file=None, admin_env=None, admin_file=str(admin_file),
                        environ={"KEYS": f" {USER} , other-user-key-0123456789"})


@pytest.mark.parametrize(
    "header, role",
    [
        (f"Bearer {USER}", Role.USER),
        (f"bearer {USER}", Role.USER),
        (f"Bearer {ADMIN}", Role.ADMIN),
        ("Bearer other-user-key-0123456789", Role.USER),
        (f"Bearer {USER[:-1]}", None),  # a prefix is not a key
        (f"Basic {USER}", None),
        ("Bearer ", None),
        (None, None),
    ],
)
def test_roles(keys, header, role):
    assert keys.role_of(header) is role


def test_authorize_says_401_or_403(keys):
    with pytest.raises(AuthenticationError, match="missing API key") as missing:
        keys.authorize(None, admin=False)
    assert missing.value.status_code == 401 and missing.value.code == "invalid_api_key"
    with pytest.raises(AuthenticationError, match="invalid API key"):
        keys.authorize("Bearer nope", admin=False)
    with pytest.raises(PermissionDeniedError) as denied:
        keys.authorize(f"Bearer {USER}", admin=True)
    assert denied.value.status_code == 403
    assert keys.authorize(f"Bearer {ADMIN}", admin=True) is Role.ADMIN
    assert keys.authorize(f"Bearer {ADMIN}", admin=False) is Role.ADMIN


def test_no_keys_or_short_keys_refuse_to_start(tmp_path):
    with pytest.raises(ValueError, match=r"no API keys were found in \$KEYS"):
        ApiKeys.load(user_env="KEYS", user_file=None, admin_env=None, admin_file=None, environ={})
    with pytest.raises(ValueError, match="shorter than 16"):
        ApiKeys.load(user_env="KEYS", user_file=None, admin_env=None, admin_file=None, environ={"KEYS": "abc"})


def test_read_keys_skips_comments_and_blanks(tmp_path):
    path = tmp_path / "k"
    path.write_text("a-key # note\n# only a comment\n\n  b-key  \n")
    assert read_keys(None, str(path), {}) == ["a-key", "b-key"]
    assert read_keys("E", None, {"E": "x,,y"}) == ["x", "y"]

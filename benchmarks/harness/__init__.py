"""What every benchmark and test harness shares: ports, processes, HTTP."""

"""Hardware: what the machine is (profile.py) and the defaults it implies (policy.py)."""

"""Task families behind one function-call API (base.py); the registry (registry.py) finds them by name."""

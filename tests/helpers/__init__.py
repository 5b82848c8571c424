"""What tests share: a topic reader, a streams worker process and synthetic load, event builders,
a vLLM engine fixture, a tiny policy, and the sandboxes' Docker engine fixture and count of what
sandboxes leave behind.

Import them as `helpers.<module>` (`from helpers.events import trajectory`): pytest puts tests/ on
sys.path for tests/conftest.py, so this works however pytest is started. The classes themselves
are library code (schemas/, pipeline/run/) that the benchmarks use too; no test imports a
benchmark module for them.
"""

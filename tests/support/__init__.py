"""Test support: helpers only the tests use (pyproject's pytest `pythonpath` puts tests/ on
sys.path, so tests import them as `support.<module>`)."""

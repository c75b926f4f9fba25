"""Helpers the tests start or import: launchers, fault injectors, counting wrappers and model factories
(tests/README.md lists them)."""

"""Max abs errors of the model parity tests: asserted per check, printed per module (run with -s)."""

import pytest


class ErrorLog:
    def __init__(self):
        self.max_errors = {}

    def record(self, name, error, tolerance):
        self.max_errors[name] = max(error, self.max_errors.get(name, 0.0))
        assert error <= tolerance, f"{name}: max abs error {error:.3e} > {tolerance:.0e}"

    def fixture(self):
        """An autouse module fixture that prints the table after the module's tests."""

        @pytest.fixture(scope="module", autouse=True)
        def report_errors():
            yield
            for name, error in sorted(self.max_errors.items()):
                print(f"max abs error {name}: {error:.3e}")

        return report_errors

"""A verifiers tool server for tests/test_verifiers_env.py. verifiers starts a task's tool server
as `python -m <its module>`, so it lives in a module of its own."""

import verifiers.v1 as vf


class Calculator(vf.Toolset[vf.ToolsetConfig]):
    """Its tools reach the model as `calculator_<name>` (verifiers prefixes the server's name)."""

    @vf.tool
    async def add(self, a: int, b: int) -> int:
        """Add two integers."""
        return a + b


if __name__ == "__main__":
    Calculator.run()

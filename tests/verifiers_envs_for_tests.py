"""verifiers environments for tests/test_verifiers_env.py, written against verifiers' public API
(`verifiers.v1`). Imported only by verifiers' own Python (.venv-verifiers), never by streamrl or pytest.

`verifiers_envs_for_tests` is a taskset id (this module exports its Taskset through `__all__`): the
product of two numbers, with a `calc_multiply` tool served by the environment's own MCP tool server (this
module run as `python -m`, which is how verifiers launches a Toolset), and a reward of 1.0 when the last
reply holds the product. Every call of the tool is logged to $VF_TOOL_LOG, so a test can count them.
"""

import os

import verifiers.v1 as vf


class ProductData(vf.TaskData):
    answer: str = ""


class CalcTools(vf.Toolset[vf.ToolsetConfig]):
    TOOL_PREFIX = "calc"

    @vf.tool
    def multiply(self, a: int, b: int) -> str:
        """Multiply two integers."""
        log = os.environ.get("VF_TOOL_LOG")
        if log:
            with open(log, "a") as f:
                f.write(f"{a}*{b}\n")
        return str(a * b)


class ProductTaskConfig(vf.TaskConfig):
    tools: vf.ToolsetConfig = vf.ToolsetConfig()


class ProductTask(vf.Task[ProductData, vf.State, ProductTaskConfig]):
    @classmethod
    def toolsets(cls, config: ProductTaskConfig) -> list[vf.Toolset]:
        return [CalcTools(config.tools)]

    @vf.reward(weight=1.0)
    async def correct(self, trace: vf.Trace) -> float:
        return 1.0 if self.data.answer in (trace.last_reply or "") else 0.0


class ProductConfig(vf.TasksetConfig):
    num_tasks: int = 4
    task: ProductTaskConfig = ProductTaskConfig()


class ProductTaskset(vf.Taskset[ProductTask, ProductConfig]):
    def load(self) -> list[ProductTask]:
        pairs = [(123, 45), (67, 89), (21, 34), (55, 12), (99, 98), (14, 15)]
        return [ProductTask(ProductData(prompt=f"{a}*{b}=", answer=str(a * b)), self.config.task)
                for a, b in (pairs * 8)[: self.config.num_tasks]]


__all__ = ["ProductTaskset"]

if __name__ == "__main__":
    CalcTools.run()

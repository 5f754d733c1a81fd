"""One loader for every setting that names code (streamrl/plugins.py): built-in names, `module:function`
and `file.py:function`, with one error format, used by workflows, rewards, tools and judge parse rules."""

from __future__ import annotations

from pathlib import Path

import pytest

from streamrl.config import ConfigError, load_config
from streamrl.judge import load_parser, yes_no
from streamrl.plugins import PluginError, is_spec, load_plugin
from streamrl.rollout.tools import ToolBox, calculator
from streamrl.rollout.workflows import WORKFLOWS, load_workflow
from streamrl.tasks import load_reward_fn

REPO = Path(__file__).parents[1]


def test_a_builtin_a_module_function_and_a_file_function(tmp_path: Path) -> None:
    assert load_plugin("yes_no", "judge parse function", {"yes_no": yes_no}) is yes_no
    assert load_plugin("streamrl.rollout.tools:calculator", "tool") is calculator
    f = tmp_path / "mine.py"
    f.write_text("class K:\n    @staticmethod\n    def go(x):\n        return x + 1\n")
    assert load_plugin(f"{f}:K.go", "reward function")(1) == 2
    assert is_spec("a.b:c") and is_spec(f"{f}:K.go") and not is_spec("calculator")


@pytest.mark.parametrize(("spec", "message"), [
    ("nothing", "workflow 'nothing' must look like 'module:function' or 'file.py:function' or one of: single_turn"),
    ("no_such_mod_xyz:f", "workflow module 'no_such_mod_xyz' not found"),
    ("streamrl.plugins:nope", "workflow 'streamrl.plugins:nope': 'streamrl.plugins' has no attribute 'nope'"),
    ("streamrl.plugins:SPEC_RE", "workflow 'streamrl.plugins:SPEC_RE' is a Pattern, which is not callable"),
    ("/no/such/file.py:f", "workflow module file /no/such/file.py does not exist"),
])
def test_errors_are_one_line_naming_what_the_setting_was_for(spec: str, message: str) -> None:
    with pytest.raises(PluginError) as e:
        load_plugin(spec, "workflow", WORKFLOWS)
    assert str(e.value).startswith(message) and "\n" not in str(e.value)


def test_a_file_that_fails_to_load_says_why_in_one_line(tmp_path: Path) -> None:
    f = tmp_path / "broken.py"
    f.write_text("raise RuntimeError('no backend')\n")
    with pytest.raises(PluginError, match=r"^tool module file .*broken.py failed to load: RuntimeError: no backend$"):
        load_plugin(f"{f}:f", "tool")


def test_every_setting_that_names_code_goes_through_the_one_loader() -> None:
    """The same mistake in each of the settings reads the same, with what it was meant to be."""
    for load, what in ((load_workflow, "workflow"), (load_reward_fn, "reward function"),
                       (load_parser, "judge parse function")):
        with pytest.raises(PluginError, match=f"^{what} module 'no_such_mod_xyz' not found"):
            load("no_such_mod_xyz:f")
    with pytest.raises(PluginError, match="^tool module 'no_such_mod_xyz' not found"):
        ToolBox(load_config(None, ["tools.functions=[t=no_such_mod_xyz:f]"]).tools)
    assert load_workflow("single_turn") is WORKFLOWS["single_turn"]


def test_a_bad_plugin_in_a_config_stops_streamrl_before_any_work() -> None:
    from streamrl.assemble import check

    cfg = load_config(REPO / "configs" / "quickstart.yaml", ["rollout.workflow=no_such_mod_xyz:f"])
    with pytest.raises(ConfigError, match="^config error: rollout.workflow: workflow module 'no_such_mod_xyz' not"):
        check(cfg)


def test_the_config_knows_every_builtin_task_and_no_other() -> None:
    """data.task is checked by the config (which imports no task) against the names the tasks register."""
    from streamrl.config.schema import KNOWN_TASKS
    from streamrl.tasks import BUILTIN_TASKS

    assert set(KNOWN_TASKS) == set(BUILTIN_TASKS)
    for name, task in BUILTIN_TASKS.items():
        assert task.prompts("held_out", seed=0) and task.warm_start is not None, name

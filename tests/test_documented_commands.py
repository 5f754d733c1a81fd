"""Every command the README and docs/ show, as a user would type it, through the installed console script.

The shell blocks of the docs are read here, so a command or flag added to a page is checked without
this file changing: each subcommand answers `--help`, each flag a page uses is one the subcommand
takes, each concrete config line (a real file, real `--set`s) passes the config check, and each
subcommand has a test elsewhere that runs it for real through the console script.
"""

from __future__ import annotations

import re
import shlex
import subprocess
from pathlib import Path

import pytest
from helpers import REPO, STREAMRL

DOCS = [REPO / "README.md", *sorted((REPO / "docs").glob("*.md"))]
SHELL = {"bash", "sh", "shell", "console", ""}

# The test that runs each subcommand for real through the console script (a model trained, a server
# answering, a plot written): this file checks the documented forms, those tests the behaviour.
REAL_RUNS = {
    "run": "tests/test_agentic.py::test_agentic_quickstart_learns_to_call_the_tool_via_cli",
    "rollout": "tests/test_rollout_cmd.py::test_rollout_writes_scored_groups_and_a_summary",
    "sweep": "tests/test_sweep.py::test_sweep_runs_every_point_and_compares_them",
    "plot": "tests/test_sweep.py::test_sweep_runs_every_point_and_compares_them",
    "config": "tests/test_cli.py::test_run_help_and_config_reference",
    "serve": "tests/test_cli.py::test_serve_through_the_console_script",
    "init-model": "tests/test_cli.py::test_init_model_and_generate",
    "generate": "tests/test_cli.py::test_init_model_and_generate",
}


def documented() -> list[tuple[str, list[str]]]:
    """(page, argv) for each `streamrl ...` or `python -m streamrl...` line of a shell block; a line
    ending in a backslash continues on the next; `# ...` comments are dropped."""
    found = []
    for page in DOCS:
        lang, pending = None, ""
        for line in page.read_text().splitlines():
            s = line.strip()
            if s.startswith("```"):
                lang = s[3:].strip() if lang is None else None
                continue
            if lang not in SHELL:
                continue
            s = pending + s
            if s.endswith("\\"):
                pending = s[:-1] + " "
                continue
            pending = ""
            argv = shlex.split(s, comments=True)
            if argv[:1] == ["streamrl"] or argv[:3] == ["python", "-m", "streamrl.engine.http.server"]:
                found.append((page.name, argv))
    return found


COMMANDS = documented()


def _cli_subcommands() -> set[str]:
    p = subprocess.run([*STREAMRL, "--help"], capture_output=True, text=True, timeout=60)
    assert p.returncode == 0, p.stderr
    return set(re.search(r"\{([a-z,-]+)\}", p.stdout).group(1).split(","))


def _sub(argv: list[str]) -> str:
    return "serve" if argv[0] == "python" else argv[1]


def _is_placeholder(arg: str) -> bool:
    return "[" in arg or "]" in arg or "|" in arg or bool(re.fullmatch(r"[A-Z][A-Z0-9_./=-]*", arg))


def test_the_docs_show_every_subcommand_and_only_real_ones() -> None:
    shown = {_sub(argv) for _, argv in COMMANDS}
    assert shown == _cli_subcommands() == set(REAL_RUNS), shown


@pytest.mark.parametrize("sub", sorted(REAL_RUNS))
def test_each_documented_flag_is_one_the_subcommand_takes(sub: str) -> None:
    p = subprocess.run([*STREAMRL, sub, "--help"], capture_output=True, text=True, timeout=60)
    assert p.returncode == 0 and p.stdout.startswith("usage: streamrl"), p.stderr
    assert "Traceback" not in p.stderr
    for page, argv in COMMANDS:
        if _sub(argv) == sub:
            for flag in (re.sub(r"[\[\]]", "", a).split("=")[0] for a in argv if a.lstrip("[").startswith("--")):
                assert re.search(rf"{re.escape(flag)}\b", p.stdout), f"{page}: {shlex.join(argv)}: no {flag}"


def test_the_server_module_takes_the_flags_docs_show() -> None:
    """docs/http.md also starts the server as a module: the same flags as `streamrl serve`."""
    module = [argv for _, argv in COMMANDS if argv[0] == "python"]
    assert module
    p = subprocess.run([str(Path(STREAMRL[0]).parent / "python"), "-m", "streamrl.engine.http.server", "--help"],
                       capture_output=True, text=True, timeout=60)
    serve = subprocess.run([*STREAMRL, "serve", "--help"], capture_output=True, text=True, timeout=60)
    assert p.returncode == 0 and serve.returncode == 0, p.stderr + serve.stderr
    flags = set(re.findall(r"--[a-z][a-z-]+", serve.stdout))
    assert flags == set(re.findall(r"--[a-z][a-z-]+", p.stdout)) and "--api-key" in flags
    for argv in module:
        assert {re.sub(r"[\[\]]", "", a) for a in argv if a.lstrip("[").startswith("--")} <= flags, argv


CONCRETE = [(page, argv) for page, argv in COMMANDS
            if argv[0] == "streamrl" and argv[1] in ("run", "rollout", "sweep")
            and not any(_is_placeholder(a) for a in argv[2:])]


def test_concrete_lines_are_found() -> None:
    # the agentic, GPU and vLLM pages each show ready-to-paste lines
    assert {page for page, _ in CONCRETE} >= {"README.md", "agentic.md", "gpu.md", "vllm.md"}


@pytest.mark.parametrize(("page", "argv"), CONCRETE, ids=[shlex.join(a[1:]) for _, a in CONCRETE])
def test_concrete_documented_configs_pass_the_config_check(page: str, argv: list[str]) -> None:
    """The config file exists and every `--set` is a valid key and value, from the checkout's root as
    the docs assume: what `streamrl run` checks before any work."""
    config, sets = argv[2], [argv[i + 1] for i, a in enumerate(argv) if a == "--set"]
    assert (REPO / config).is_file(), f"{page}: {config} does not exist"
    cmd = [*STREAMRL, "config", config]
    for s in sets:
        cmd += ["--set", s]
    p = subprocess.run(cmd, capture_output=True, text=True, timeout=60, cwd=REPO)
    assert p.returncode == 0, f"{page}: {shlex.join(argv)}: {p.stderr}"
    for s in sets:  # the override is what the file's values show
        key, value = s.split("=", 1)
        assert re.search(rf'^{re.escape(key)}: [^#]*= "?{re.escape(value)}"?  #', p.stdout, re.M), s


@pytest.mark.parametrize("sub", sorted(REAL_RUNS))
def test_each_subcommand_has_a_test_that_runs_it_through_the_console_script(sub: str) -> None:
    path, name = REAL_RUNS[sub].split("::")
    text = (REPO / path).read_text()
    assert re.search(rf"^(async )?def {name}\(", text, re.M), REAL_RUNS[sub]
    assert "STREAMRL" in text and f'"{sub}"' in text, f"{path} does not run `streamrl {sub}`"


def test_the_two_commands_are_the_ones_the_tests_and_ci_run() -> None:
    """`bash scripts/quickstart.sh` is setup plus the quickstart command that `run_quickstart_cli`
    (tests/test_run.py) trains through; `bash scripts/test.sh` is what `.ci/run` calls."""
    readme = (REPO / "README.md").read_text()
    assert "bash scripts/quickstart.sh" in readme and "bash scripts/test.sh" in readme
    quick = (REPO / "scripts" / "quickstart.sh").read_text().splitlines()
    assert "bash scripts/setup.sh" in quick
    assert quick[-1] == 'exec .venv/bin/streamrl run configs/quickstart.yaml "$@"'
    assert "bash scripts/test.sh" in (REPO / ".ci" / "run").read_text()
    for script in ("quickstart.sh", "test.sh", "setup.sh"):
        assert subprocess.run(["bash", "-n", str(REPO / "scripts" / script)]).returncode == 0

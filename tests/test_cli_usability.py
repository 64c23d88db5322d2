"""What a user meets at the `kvflow` command line: one-line argument errors that come before any heavy
import, no abbreviated flags, every option's help with its default, --version, a busy port reported
before the model loads (the address printed only once the server listens: tests/api/test_api_cli.py)."""

from __future__ import annotations

import argparse
import ast
import socket
import subprocess
import sys
from pathlib import Path

import pytest

import kvflow
from kvflow.cli.args import _NO_DEFAULT_SHOWN, _SAYS_DEFAULT, HelpFormatter
from kvflow.cli.main import build_parser, main

ROOT = Path(__file__).resolve().parents[1]


def _run(code: str, timeout: float = 60) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=timeout, cwd=ROOT)


def _main_without_torch(argv: list[str]) -> subprocess.CompletedProcess:
    """`kvflow ARGV` in a fresh interpreter that exits 3 if the command imported torch or the model stack."""
    code = ("import sys\n"
            "from kvflow.cli.main import main\n"
            f"rc = main({argv!r})\n"
            "heavy = [m for m in ('torch', 'fastapi', 'kvflow.engine', 'kvflow.api.server') if m in sys.modules]\n"
            "sys.exit(3 if heavy else rc)\n")
    return _run(code)


def test_version(capsys):
    assert main(["--version"]) == 0
    assert capsys.readouterr().out.strip() == f"kvflow {kvflow.__version__}"


@pytest.mark.parametrize("argv, says", [
    (["serve", "--mode", "bad"], "argument --mode: invalid choice: 'bad'"),
    (["serve", "--port", "70000"], "argument --port: must be <= 65535"),
    (["serve", "--kv-cache-gb", "0"], "argument --kv-cache-gb: must be > 0"),
    (["serve", "--prompt-depth", "2"], "--prompt-depth need --mode colocated or disaggregated"),
    (["serve", "--gpu-memory-utilization", "1.5"], "argument --gpu-memory-utilization: must be <= 1"),
    (["serve", "--gpu-memory-utilization", "0.9"], "--gpu-memory-utilization needs --device cuda"),
    (["serve", "--gpu-memory-utilization", "0.9", "--mode", "colocated"], "--gpu-memory-utilization needs --device cuda"),
    (["serve", "--gpu-memory-utilization", "0.9", "--mode", "disaggregated", "--device", "cpu"], "on CPU, give --kv-cache-gb"),
    (["serve", "--model", "/nonexistent/model.gguf"], "not found"),
    (["generate", "hi", "--top-p", "0"], "argument --top-p: must be > 0, got 0"),
    (["generate", "hi", "--raw", "--system", "x"], "--system needs the chat template"),
    (["chat", "--temperature", "-1"], "argument --temperature: must be >= 0"),
    (["plan", "--machines", "x"], "argument --machines: not an integer: 'x'"),
    (["plan", "--machines", "4", "--output", "foo"], "argument --output: use lmsys"),
    (["plan", "--machines", "4", "--ttft-slo", "1"], "give both --ttft-slo and --tpot-slo"),
    (["simulate", "--microbatches", "a,b"], "argument --microbatches: expected comma-separated integers"),
    (["profile", "--batches", "0"], "argument --batches: expected positive integers"),
    (["simulate"], "give --scenario FILE or --layout"),
    (["simulate", "--layout", "3x"], "argument --layout: layout part '3x'"),
    (["bench", "serve", "--rates", "1,x"], "argument --rates: expected comma-separated numbers"),
    (["bench", "serve", "--url", "http://10.1.2.3:8000"], "only targets 127.0.0.1/localhost, not '10.1.2.3'"),
    (["worker", "--name", "w"], "the following arguments are required: --controller"),
])
def test_argument_errors_are_one_line_and_import_nothing_heavy(argv, says):
    r = _main_without_torch(argv)
    assert r.returncode == 2, (r.returncode, r.stderr)
    assert says in r.stderr
    assert len(r.stderr.strip().splitlines()) == 1, r.stderr  # not a 30-line usage block
    assert r.stdout == ""


@pytest.mark.parametrize("argv", [["serve", "--max-num-seq", "3"], ["generate", "hi", "--max-token", "3"],
                                  ["plan", "--machine", "2xA100-80GB", "--machines", "2", "--max-dep", "2"]])
def test_abbreviated_flags_are_rejected(argv, capsys):
    assert main(argv) == 2
    err = capsys.readouterr().err
    assert "unrecognized arguments" in err and len(err.strip().splitlines()) == 1


def explain_defaults(parser: argparse.ArgumentParser) -> list[str]:
    """The options of `parser` and its sub-commands that have no help text, or whose help shows no
    default though they take a value."""
    missing = []
    for action in parser._actions:
        if isinstance(action, argparse._SubParsersAction):
            for sub in action.choices.values():
                missing += explain_defaults(sub)
            continue
        if not action.option_strings or isinstance(action, (argparse._HelpAction, argparse._VersionAction)):
            continue
        name = f"{parser.prog} {'/'.join(action.option_strings)}"
        text = HelpFormatter(parser.prog)._get_help_string(action) if action.help else ""
        if not action.help:
            missing.append(f"{name}: no help")
        elif not (_SAYS_DEFAULT.search(text) or isinstance(action, _NO_DEFAULT_SHOWN) or action.required):
            missing.append(f"{name}: help does not say the default")
    return missing


def test_every_command_option_has_help_with_its_default():
    assert explain_defaults(build_parser()) == []


def test_help_formatter_shows_defaults_once():
    serve = build_parser()._subparsers._group_actions[0].choices["serve"]
    text = serve.format_help()
    assert "--max-num-seqs MAX_NUM_SEQS\n" in text and "(default: 64)" in text
    assert "(default: 127.0.0.1)" in text and "(default: None)" not in text
    # the options are grouped, not one list of forty
    for group in ("model:", "HTTP server:", "scheduling:", "KV cache:", "pipeline modes:", "Ray launcher"):
        assert f"\n{group}" in text, group


BENCHMARKS = sorted(p for p in (ROOT / "benchmarks").glob("*.py")
                    # owned elsewhere: their flags get help texts from their own engineer
                    if p.name not in ("serving.py", "offline.py"))


@pytest.mark.parametrize("path", BENCHMARKS, ids=lambda p: p.name)
def test_every_benchmark_flag_has_help(path):
    """Each benchmark has a description, shows its defaults (kvflow's parser, or argparse's with
    ArgumentDefaultsHelpFormatter) and gives every flag a help text (checked in the source: importing
    a benchmark can import torch)."""
    tree = ast.parse(path.read_text())
    calls = [n for n in ast.walk(tree) if isinstance(n, ast.Call)]
    parsers = [c for c in calls if isinstance(c.func, (ast.Attribute, ast.Name))
               and (c.func.attr if isinstance(c.func, ast.Attribute) else c.func.id) == "ArgumentParser"]
    assert parsers, "no ArgumentParser"
    for c in parsers:  # kvflow's parser, or argparse's showing the defaults
        formatter = next((ast.unparse(k.value) for k in c.keywords if k.arg == "formatter_class"), "")
        assert isinstance(c.func, ast.Name) or "Defaults" in formatter, f"line {c.lineno}: defaults not shown"
        assert any(k.arg == "description" for k in c.keywords) or c.args, f"line {c.lineno}: no description"
    missing = [c.lineno for c in calls if isinstance(c.func, ast.Attribute) and c.func.attr == "add_argument"
               and not any(k.arg == "help" for k in c.keywords)]
    assert missing == [], f"add_argument without help at lines {missing}"


def test_busy_port_fails_in_one_line_before_the_model_loads():
    with socket.socket() as busy:
        busy.bind(("127.0.0.1", 0))
        busy.listen()
        port = busy.getsockname()[1]
        r = _main_without_torch(["serve", "--port", str(port)])
    assert r.returncode == 2, r.stderr
    assert r.stderr.strip().splitlines() == [
        f"kvflow serve: error: cannot listen on 127.0.0.1:{port}: Address already in use "
        "(another server is listening there; pick another --port)"]


def test_plots_without_matplotlib_say_what_to_install(monkeypatch):
    from kvflow.plotting import MissingExtra, pyplot

    monkeypatch.setitem(sys.modules, "matplotlib", None)  # as if the `plot` extra were not installed
    with pytest.raises(MissingExtra, match=r"pip install 'kvflow\[plot\]'"):
        pyplot()


def test_serving_needs_no_matplotlib():
    r = _run("import sys\nsys.modules['matplotlib'] = None\n"
             "import kvflow.api.server, kvflow.cli.main, kvflow.bench.report, kvflow.planner.report\n")
    assert r.returncode == 0, r.stderr


def test_container_recipe_copies_what_exists_and_serves_with_valid_flags():
    # the image cannot be built here (no network); what can be checked without it is checked
    lines = [ln.strip() for ln in (ROOT / "Containerfile").read_text().splitlines() if ln.strip() and not ln.startswith("#")]
    for ln in lines:
        if ln.startswith("COPY "):
            for src in ln.split()[1:-1]:
                assert (ROOT / src).exists(), src
    cmd = next(ln for ln in lines if ln.startswith("CMD "))
    argv = __import__("json").loads(cmd[4:])
    assert argv[:2] == ["kvflow", "serve"] and "0.0.0.0" in argv
    args = build_parser().parse_args(argv[1:])
    assert args.host == "0.0.0.0" and args.port == 8000
    assert any("torch==" in ln and "whl/cpu" in ln for ln in lines)  # the CPU build, not the CUDA one

"""The reference docs name only code that exists.

Every page of docs/ but the results log (docs/results.md, a dated record that may name code since
removed) and README.md are read as text; the source is parsed with `ast` (only the `kvflow` command's
parser is imported, which imports no torch), so this runs in about a second. A page fails when it names:

- a path under kvflow/, benchmarks/, scripts/, tests/ or scenarios/ that is not there, or a file
  `x.py` / `pkg/x.py` in backticks that no such folder holds;
- a dotted module `kvflow.x.y` that is not a module or package, or a name in it that the module
  does not define (`kvflow.x.y.Name`);
- `module.name` (a kvflow module by its file name, e.g. `topology.stream_out`) or `Class.member`
  (a kvflow class) where the module or the class has no such name;
- a backticked identifier that looks like code (`snake_case` or `CamelCase`) and occurs nowhere in
  the code base's source text: how a primitive that was removed (`stream_in`) stays in a page;
- a link to a page of docs/ that is not there, or to a heading (`results.md#2026-11-25-fidelity`)
  the page does not have;
- a `--flag` that no kvflow command, benchmark or script defines, or a `kvflow_*` metric the code
  does not expose; and the reverse: every `kvflow serve` option is on some page of docs/, every
  metric of the API server in docs/api.md.

Inline code only: fenced blocks (commands, pseudo-code) are checked for paths alone.
"""

from __future__ import annotations

import ast
import re
from functools import cache
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
PAGES = sorted(p for p in (ROOT / "docs").glob("*.md") if p.name != "results.md") + [ROOT / "README.md"]
TREES = ("kvflow", "benchmarks", "scripts", "tests", "scenarios")
SOURCE_SUFFIXES = {".py", ".sh", ".cpp", ".h", ".yaml", ".toml", ".cfg"}
FILE_SUFFIXES = {"py", "md", "json", "yaml", "png", "csv", "gguf", "safetensors", "txt", "sh", "cpp", "h", "so",
                 "toml", "lock"}

# Names of other software's things that pages name on purpose (a Ray resource, a Ray file).
EXTERNAL = frozenset({"host_a", "host_b", "ray_current_cluster"})

FENCE = re.compile(r"^(```|~~~).*?^\1", re.S | re.M)
INLINE = re.compile(r"`([^`\n]+)`")
PATH = re.compile(r"(?<![\w./-])((?:%s)/[\w./-]*[\w/])(?![\w*<{])" % "|".join(TREES))
SHORT_FILE = re.compile(r"^(?:[a-z_][\w]*/)*[a-z_]\w*\.py$")
DOTTED = re.compile(r"^[A-Za-z_]\w*(?:\.[A-Za-z_]\w*)+$")
IDENT = re.compile(r"^[A-Za-z_]\w*$")
LINK = re.compile(r"\]\(([\w./-]+\.md)(?:#([\w-]+))?\)")


def _code_like(name: str) -> bool:
    """snake_case with an underscore inside, or CamelCase with a lower-case letter after an inner capital."""
    core = name.strip("_")
    return ("_" in core and not core.isupper()) or bool(re.search(r"[a-z][A-Z]|^[A-Z][a-z]+[A-Z]", core))


@cache
def sources() -> list[Path]:
    out = []
    for tree in TREES:
        out += [p for p in (ROOT / tree).rglob("*") if p.suffix in SOURCE_SUFFIXES and "__pycache__" not in p.parts]
    return [p for p in out if p != Path(__file__).resolve()]  # (this file names removed code on purpose)


@cache
def source_words() -> frozenset[str]:
    return frozenset(w for p in sources() for w in re.findall(r"\w+", p.read_text(errors="replace")))


@cache
def module_files() -> dict[str, Path]:
    """Dotted module name -> file, for every module and package of kvflow."""
    out = {}
    for p in (ROOT / "kvflow").rglob("*.py"):
        parts = p.relative_to(ROOT).with_suffix("").parts
        out[".".join(parts[:-1] if parts[-1] == "__init__" else parts)] = p
    return out


@cache
def parsed(path: Path) -> ast.Module:
    return ast.parse(path.read_text(), str(path))


def _targets(node) -> list[str]:
    if isinstance(node, ast.Assign):
        return [n for t in node.targets for n in _names(t)]
    if isinstance(node, (ast.AnnAssign, ast.AugAssign)):
        return _names(node.target)
    return []


def _names(t) -> list[str]:
    if isinstance(t, ast.Name):
        return [t.id]
    if isinstance(t, (ast.Tuple, ast.List)):
        return [n for e in t.elts for n in _names(e)]
    return []


@cache
def module_names(mod: str) -> frozenset[str]:
    """What `mod` defines at top level (functions, classes, assignments, imports, `__all__`) and its submodules."""
    names = {m[len(mod) + 1:].split(".")[0] for m in module_files() if m.startswith(mod + ".")}
    tree = parsed(module_files()[mod])
    for node in tree.body:
        if isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef, ast.ClassDef)):
            names.add(node.name)
        elif isinstance(node, (ast.Import, ast.ImportFrom)):
            names.update((a.asname or a.name).split(".")[0] for a in node.names)
        elif isinstance(node, (ast.If, ast.Try)):
            for sub in ast.walk(node):
                if isinstance(sub, (ast.FunctionDef, ast.ClassDef)):
                    names.add(sub.name)
                names.update(_targets(sub))
        names.update(_targets(node))
        if isinstance(node, ast.Assign) and "__all__" in _targets(node) and isinstance(node.value, (ast.List, ast.Tuple)):
            names.update(e.value for e in node.value.elts if isinstance(e, ast.Constant))
    return frozenset(names)


@cache
def classes() -> dict[str, list[tuple[set[str], list[str]]]]:
    """Class name -> [(its members, its base names)] over every class of kvflow (names may repeat)."""
    out: dict[str, list[tuple[set[str], list[str]]]] = {}
    for path in module_files().values():
        for node in ast.walk(parsed(path)):
            if not isinstance(node, ast.ClassDef):
                continue
            members: set[str] = set()
            for item in node.body:
                if isinstance(item, (ast.FunctionDef, ast.AsyncFunctionDef, ast.ClassDef)):
                    members.add(item.name)
                members.update(_targets(item))
            for sub in ast.walk(node):  # self.x = ... in any method
                for t in (sub.targets if isinstance(sub, ast.Assign) else [getattr(sub, "target", None)]):
                    if isinstance(t, ast.Attribute) and isinstance(t.value, ast.Name) and t.value.id == "self":
                        members.add(t.attr)
            bases = [b.id if isinstance(b, ast.Name) else getattr(b, "attr", "") for b in node.bases]
            out.setdefault(node.name, []).append((members, bases))
    return out


def class_has(name: str, member: str, seen: frozenset[str] = frozenset()) -> bool:
    for members, bases in classes().get(name, []):
        if member in members or any(class_has(b, member, seen | {name}) for b in bases if b not in seen):
            return True
    return False


def module_has(mod: str, rest: list[str]) -> bool:
    """`rest` (a name, or Class.member) is defined in module `mod`."""
    if rest[0] not in module_names(mod):
        return False
    return len(rest) == 1 or (rest[0] in classes() and class_has(rest[0], rest[1])) or f"{mod}.{rest[0]}" in module_files()


def instance_has(mod: str, member: str) -> bool:
    """A class defined in module (or package) `mod` has `member`: `backend.healthy` names a Backend's method."""
    files = [f for m, f in module_files().items() if m == mod or m.startswith(mod + ".")]
    return any(isinstance(n, ast.ClassDef) and class_has(n.name, member) for f in files for n in parsed(f).body)


def resolve_kvflow(dotted: str) -> str | None:
    """None if `kvflow.x.y[.Name[.member]]` exists, else what is missing."""
    parts = dotted.split(".")
    for i in range(len(parts), 0, -1):
        mod = ".".join(parts[:i])
        if mod in module_files():
            rest = parts[i:]
            if not rest:
                return None
            if len(rest) > 2:
                return f"{'.'.join(rest)} (too deep) in {mod}"
            if module_has(mod, rest) or (len(rest) == 2 and f"{mod}.{rest[0]}" in module_files()
                                          and rest[1] in module_names(f"{mod}.{rest[0]}")):
                return None
            return f"{'.'.join(rest)} is not defined in {mod}"
    return f"no module {dotted}"


def check_dotted(token: str) -> str | None:
    """None when `token` names existing code or is not kvflow's to check; else the problem."""
    parts = token.split(".")
    if parts[-1] in FILE_SUFFIXES:
        return None
    if parts[0] == "kvflow":
        return resolve_kvflow(token)
    if f"kvflow.{parts[0]}" in module_files():  # sched.scheduler.Scheduler, perf.calibrate.merge_profiles
        why = resolve_kvflow("kvflow." + token)
        return None if why is None or (len(parts) == 2 and instance_has(f"kvflow.{parts[0]}", parts[1])) else why
    by_file = [m for m in module_files() if m.split(".")[-1] == parts[0] and not module_files()[m].name == "__init__.py"]
    if by_file:  # topology.stream_out, cpu_kernels.decode_layers
        if any(module_has(m, parts[1:3]) or (len(parts) == 2 and instance_has(m, parts[1])) for m in by_file):
            return None
        return f"{'.'.join(parts[1:])} is not defined in {' or '.join(by_file)}"
    if parts[0] in classes():  # Scheduler.rewind, PerfModel.kv_capacity_tokens
        if class_has(parts[0], parts[1]):
            return None
        return f"class {parts[0]} has no {parts[1]}"
    return None


def check_path(text: str) -> str | None:
    path = text.rstrip("/.")
    if "*" in path or "<" in path or "{" in path:
        return None
    return None if (ROOT / path).exists() else f"no such path {path}"


def check_short_file(name: str) -> str | None:
    if any(str(p.relative_to(ROOT)).endswith(name) and p.name == Path(name).name for p in sources()):
        return None
    return f"no file {name} under {', '.join(TREES)}"


def anchor(heading: str) -> str:
    """GitHub's anchor of a heading: lower case, punctuation dropped, spaces to hyphens."""
    return re.sub(r"[^\w\- ]", "", heading.strip().lower()).replace(" ", "-")


@cache
def anchors(page: Path) -> frozenset[str]:
    text = FENCE.sub("", page.read_text())
    return frozenset(anchor(h) for h in re.findall(r"^#+ (.+)$", text, re.M))


def check_link(page: Path, target: str, fragment: str | None) -> str | None:
    dest = (page.parent / target).resolve()
    if not dest.exists():
        return f"no page {target}"
    if fragment and fragment not in anchors(dest):
        return f"no heading #{fragment} in {target}"
    return None


def problems(page: Path) -> list[str]:
    text = page.read_text()
    found = [f"{m} ({check_path(m)})" for m in PATH.findall(text) if check_path(m)]
    found += [f"link {t}{'#' + f if f else ''}: {why}" for t, f in LINK.findall(text) if (why := check_link(page, t, f))]
    prose = FENCE.sub("", text)
    for raw in INLINE.findall(prose):
        if "*" in raw:  # a glob (tests/test_model*.py)
            continue
        for token in re.split(r"[\s,;:=()\[\]{}<>|\"'+*/]+(?=\S)", raw) if not SHORT_FILE.match(raw) else [raw]:
            token = token.strip(".,;:()[]`'\"")
            if token.endswith("()"):
                token = token[:-2]
            why = None
            if SHORT_FILE.match(token):
                why = check_short_file(token)
            elif DOTTED.match(token):
                why = check_dotted(token)
            elif IDENT.match(token) and _code_like(token) and token not in source_words() | EXTERNAL:
                why = "found nowhere in the source"
            if why:
                found.append(f"`{token}`: {why}")
    return sorted(set(found))


@pytest.mark.parametrize("page", PAGES, ids=lambda p: p.name)
def test_page_names_only_existing_code(page):
    assert problems(page) == [], f"{page.relative_to(ROOT)} names code that does not exist"


def test_the_check_catches_a_removed_name(tmp_path):
    page = tmp_path / "page.md"
    page.write_text("| 3 | `topology.stream_in` | `stream_in` | `kvflow/streaming/gone.py` | `kvflow.streaming.gone` |"
                    " `Scheduler.no_such_method` | `kvflow.sched.scheduler.Scheduler.schedule` |\n"
                    "[a](nowhere.md), [b](page.md#no-such-heading)\n")
    assert problems(page) == [
        "`Scheduler.no_such_method`: class Scheduler has no no_such_method",
        "`kvflow.streaming.gone`: gone is not defined in kvflow.streaming",
        "`kvflow/streaming/gone.py`: no file kvflow/streaming/gone.py under kvflow, benchmarks, scripts, tests, scenarios",
        "`stream_in`: found nowhere in the source",
        "`topology.stream_in`: stream_in is not defined in kvflow.streaming.topology",
        "kvflow/streaming/gone.py (no such path kvflow/streaming/gone.py)",
        "link nowhere.md: no page nowhere.md",
        "link page.md#no-such-heading: no heading #no-such-heading in page.md",
    ]


# ---------------------------------------------------------------------------------------- flags and metrics
# The docs and the code agree on the command line and /metrics: every `--flag` a page names is an option
# of some kvflow command, benchmark or script (or another tool's, listed here), every `kvflow_*` metric a
# page names is exposed by the code, and the reverse: every option of `kvflow serve` and every metric of
# the API server is documented. The commands' options come from the `kvflow` parser itself (importing
# kvflow.cli.main imports no torch); the benchmarks' and other modules' from their source (`ast`).

FLAG = re.compile(r"(?<![\w-])(--[a-z][a-z0-9]*(?:-[a-z0-9]+)*)")
METRIC = re.compile(r"(?<![\w])(kvflow_[a-z0-9_]+)")
METRIC_SUFFIXES = ("_total", "_bucket", "_count", "_sum", "_created")
# Other programs' options that pages show on purpose: `ray start`'s (docs/deploy.md), `pip wheel`'s.
EXTERNAL_FLAGS = frozenset({"--head", "--address", "--node-ip-address", "--num-cpus", "--resources", "--labels",
                            "--include-dashboard", "--wheel-dir", "--dest", "--find-links"})  # (ray's, pip's)


def _documented_text(pages: list[Path]) -> str:
    return "\n".join(p.read_text() for p in pages)


@cache
def command_flags() -> dict[str, set[str]]:
    """`kvflow` sub-command (e.g. "serve", "bench serve") -> its option strings."""
    import argparse

    from kvflow.cli.main import build_parser

    out: dict[str, set[str]] = {}

    def walk(parser: argparse.ArgumentParser, prefix: str) -> None:
        for action in parser._actions:
            if isinstance(action, argparse._SubParsersAction):
                for name, sub in action.choices.items():
                    walk(sub, f"{prefix} {name}".strip())
            else:
                out.setdefault(prefix, set()).update(action.option_strings)

    walk(build_parser(), "")
    return out


@cache
def source_flags() -> frozenset[str]:
    """Option strings of every `add_argument` call in kvflow/, benchmarks/ and scripts/ (with the --no-
    forms of BooleanOptionalAction), and every `--flag` a shell script passes on."""
    flags: set[str] = set()
    for path in sources():
        if path.suffix == ".sh":
            flags.update(FLAG.findall(path.read_text()))
            continue
        if path.suffix != ".py" or path.parts[len(ROOT.parts)] not in ("kvflow", "benchmarks", "scripts"):
            continue
        for node in ast.walk(parsed(path)):
            if isinstance(node, ast.Call) and getattr(node.func, "attr", "") == "add_argument":
                names = [a.value for a in node.args if isinstance(a, ast.Constant) and str(a.value).startswith("--")]
                flags.update(names)
                if any(k.arg == "action" and "BooleanOptional" in ast.unparse(k.value) for k in node.keywords):
                    flags.update("--no-" + n[2:] for n in names)
    return frozenset(flags)


@cache
def metric_names() -> frozenset[str]:
    """Every `kvflow_*` string constant of kvflow/ (the names of the /metrics families), suffixes stripped."""
    out = set()
    for path in (ROOT / "kvflow").rglob("*.py"):
        for node in ast.walk(parsed(path)):
            if isinstance(node, ast.Constant) and isinstance(node.value, str) and METRIC.fullmatch(node.value):
                out.add(_metric_base(node.value))
    return frozenset(out)


def _metric_base(name: str) -> str:
    for suffix in METRIC_SUFFIXES:
        if name.endswith(suffix):
            return name[: -len(suffix)]
    return name


def api_metric_names() -> set[str]:
    """The families the API server exposes (kvflow/api/metrics.py)."""
    tree = parsed(ROOT / "kvflow" / "api" / "metrics.py")
    return {_metric_base(n.value) for n in ast.walk(tree)
            if isinstance(n, ast.Constant) and isinstance(n.value, str) and METRIC.fullmatch(n.value)}


def flag_problems(pages: list[Path]) -> list[str]:
    known = source_flags() | {f for flags in command_flags().values() for f in flags} | EXTERNAL_FLAGS
    out = []
    for page in pages:
        for flag in sorted(set(FLAG.findall(page.read_text())) - known):
            out.append(f"{page.name}: {flag} is no option of kvflow, a benchmark or a script")
    return out


def metric_problems(pages: list[Path]) -> list[str]:
    out = []
    for page in pages:
        for name in sorted(set(METRIC.findall(page.read_text()))):
            if _metric_base(name) not in metric_names() and not name.startswith("kvflow_cpu_kernels"):
                out.append(f"{page.name}: metric {name} is not exposed by the code")
    return out


def test_pages_name_only_existing_flags_and_metrics():
    assert flag_problems(PAGES) + metric_problems(PAGES) == []


def test_every_serve_flag_and_metric_is_documented():
    docs = _documented_text([p for p in PAGES if p.name != "README.md"])
    undocumented = sorted(f for f in command_flags()["serve"] if f.startswith("--") and f != "--help"
                          and not f.startswith("--no-") and not re.search(rf"(?<![\w-]){re.escape(f)}(?![\w-])", docs))
    assert undocumented == [], "kvflow serve options no page of docs/ mentions"
    api = (ROOT / "docs" / "api.md").read_text()
    missing = sorted(m for m in api_metric_names() if not re.search(rf"\b{m}", api))
    assert missing == [], "metrics of the API server that docs/api.md does not list"


def test_the_flag_and_metric_checks_catch_strays(tmp_path):
    page = tmp_path / "page.md"
    page.write_text("`kvflow serve --max-num-seqs 8 --max-num-seq 8`, `kvflow_num_requests_running`, "
                    "`kvflow_no_such_metric_total`, `kvflow_time_to_first_token_seconds_bucket`\n")
    assert flag_problems([page]) == ["page.md: --max-num-seq is no option of kvflow, a benchmark or a script"]
    assert metric_problems([page]) == ["page.md: metric kvflow_no_such_metric_total is not exposed by the code"]

"""The library's shape, checked on every run: no import cycles, and files and the whole kept small.

Why a test: cycles and 1,000-line files came back by accretion each time nothing stopped them.
Imports are read with `ast` (nothing is imported), so the check is exact and fast. An edge
`a -> b` is any import of `b` written in `a`, at any depth, except under `if TYPE_CHECKING:`;
`from pkg import name` reaches `pkg/name.py` when that is a module, else `pkg/__init__.py`.
"""

from __future__ import annotations

import ast
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
PACKAGES = ("vllm_delta", "megatron_hook")
MAX_FILE_LINES = 450
# Files still over MAX_FILE_LINES, with the size they may not grow past; each entry is owed a split.
OVERSIZE: dict[str, int] = {}
# Formatted with `ruff format`: 11.6 % more lines than the hand-wrapped code it replaced (18,269 -> 20,389
# lines on the tree before 31ff4d6). The redesign's target is 13,000 hand-wrapped lines (about 14,500
# formatted); issues 31-33 then added 1,241 lines of features, so about 15,750 like for like. Lowered as
# the library shrinks.
# +215: signed manifests (issue 33); +75: our own weight-transfer backend name (issue 31); -118: one loader
# interception (issue 30); +73: the seed trainer's push (issue 31); +306: block-fp8 sender and the fp8
# refusals (issue 32); -3: one Decoder interface (issue 30); +205: verl and SkyRL integrations (issue 31);
# +14: the trace's critical rank and the LM head's repack built ahead (issue 30); +93: hostile files
# (issue 33); +14: one lineage module (issue 30); +170: TRL (issue 31); -207: wire/transports/sender merges
# (issue 30); -303: the doors as subclasses of the core, one body parser and one refusal log, placement
# absorbs owned/reach, the probe's passes fill a TensorPlacement, shorter docstrings (issue 30); +178:
# post-load steps run in prepare on stand-ins, the pause holding copies only (issue 30); -101: Shard/Segments
# placement helpers, dense codecs, DeltaBatch dataclass (issue 30); -38: reader/s3/flush_encode (issue 30);
# -104: a not-on-disk prepare as one typed object, the fallback replay as Shadows methods, one chunk builder
# (issue 30); -132: gaps_jit, which did not pay at the users' scale (issue 30); -286: transports one
# module each (s3_receive, spool, writer merged), one S3 retry path, docstrings, dead client options
# (issue 30); -16: one bits view for the kernels (issue 30); -476: the engine core and doors merged
# into fewer modules, flags exported after parsing, one answer helper (issue 30); -29: one check_args
# for both doors, single-caller helpers inlined (issue 30); -660: one interval helper, one locate, one
# in-place re-run, one post-load observer, one meta probe pass, one prepare, docstrings cut to their why
# in the apply/placement files (issue 30); -536: wire's second head check and batch views, one batched
# decode for host and device, codec helpers inlined, docstrings (issue 30); -3: wire docstrings (issue 30);
# -448: sender and megatron_hook modules merged (segments, anchor, prober, ranks, snapshot_place,
# checkpoint_seed, names, bindings), one-caller helpers inlined, docstrings (issue 30); -180: one sealed
# loader run and copy reading for probe/careful pass/fallback replay, placement.grid, docstrings (issue 30);
# -259: wire's write side: flush_encode merged into writer (one encode loop for both layouts), the
# manifest's params validated by pydantic alone, safetensors packed by hand (issue 30); -33: one block
# list per param in the encode, load_manifest through DeltaDir (issue 30); -286: engine core and doors:
# commit returns the answer, fewer message shapes, refusals raised where found (issue 30); -127: one Unit
# per post-load step (quant methods' reruns and derived units), one prebuild and one install (issue 30);
# -26: one two-doors refusal, the worker's collective init validated as the door's message (issue 30); -265:
# transports' stored half shared, registry in base, kernels' jit/scan_buffers folded, unused async client API
# (issue 30); -4: the collective timeout bound inline, the seed answer's body (issue 30); -17: scatter keying
# inline, kernel docstrings (issue 30); -172: one sender scan (every shard in a bucket, anchors too), the
# publisher's metrics, one strided view (issue 30); -91: wire's read side, the flush dispatch inlined, codec
# helpers, docstrings (issue 30); -14: wire read-side docstrings (issue 30); -16: megatron_hook docstrings
# (issue 30); -22: map_check's layer pass inlined, owned_ranges folded into owned_by_tensor (issue 30);
# -226: the apply path's one plan/cache for locating (Known into Plan's groups, Landed into Route), one
# served-dtype check, digests read from the Sums rows (issue 30); -14: wire
# docstrings (issue 30); -13: transforms' layout check inlined,
# docstrings (issue 30); -41: one gap codec and one value codec (planes a flag), the seed's positions
# through them, heads_from_text's kernel import (issue 30); -164: transports, kernels, weight_transfer and
# top-level modules: one HTTP reply parser, the params scan's checks chained, docstrings (issue 30); -31:
# the CLI's subcommands through one helper, host_group(refused=), docstrings (issue 30); -95: one
# post-load observer, engine wrappers and re-exports inlined (issue 30); -158: wire's per-param decode
# (one frame loop, the codecs called directly), parse_index takes the param, one decode device (issue 30);
# -164: sender/hook/integrations' inlined one-use helpers, one shift map, shorter calls and docstrings (issue
# 30); -77: the sender's failure metrics once, wait() without a forwarder, fp8's scale names and checks (issue
# 30); -76: the params scan's readers chained, scan_runs' one copy loop, raises and docstrings in
# transports/kernels/doors (issue 30); +2: the worker's frozen heap unfrozen at exit (issue 30); +6:
# EngineClient's backoff_s back (tests set it; issue 30).
MAX_LIBRARY_LINES = 15_924


def _files() -> dict[str, Path]:
    """Dotted module name -> file, for every module of the library (a package is its `__init__`)."""
    out = {}
    for package in PACKAGES:
        for path in sorted((ROOT / package).rglob("*.py")):
            parts = path.relative_to(ROOT).with_suffix("").parts
            out[".".join(parts[:-1] if parts[-1] == "__init__" else parts)] = path
    return out


def _type_checking_only(node: ast.If) -> bool:
    return (
        isinstance(node.test, ast.Name)
        and node.test.id == "TYPE_CHECKING"
        or (isinstance(node.test, ast.Attribute) and node.test.attr == "TYPE_CHECKING")
    )


def _imports(module: str, path: Path, known: dict[str, Path]) -> set[str]:
    """The library modules `module` imports."""
    is_package = path.name == "__init__.py"
    out: set[str] = set()

    def visit(node: ast.AST) -> None:
        if isinstance(node, ast.If) and _type_checking_only(node):
            for child in node.orelse:
                visit(child)
            return
        if isinstance(node, ast.Import):
            out.update(a.name for a in node.names if a.name in known)
        elif isinstance(node, ast.ImportFrom):
            base = node.module or ""
            if node.level:
                anchor = module.split(".") if is_package else module.split(".")[:-1]
                anchor = anchor[: len(anchor) - (node.level - 1)]
                base = ".".join([*anchor, base] if base else anchor)
            modules = {f"{base}.{a.name}" for a in node.names} & known.keys()
            out.update(modules)
            if base in known and len(modules) < len(node.names):  # a name the package's __init__ holds
                out.add(base)
        for child in ast.iter_child_nodes(node):
            visit(child)

    visit(ast.parse(path.read_text(), str(path)))
    out.discard(module)
    return out


def _cycles(graph: dict[str, set[str]]) -> list[list[str]]:
    """Strongly connected components of more than one node (Tarjan), each sorted."""
    index: dict[str, int] = {}
    low: dict[str, int] = {}
    stack: list[str] = []
    on_stack: set[str] = set()
    found: list[list[str]] = []

    def connect(v: str) -> None:
        index[v] = low[v] = len(index)
        stack.append(v)
        on_stack.add(v)
        for w in sorted(graph.get(v, ())):
            if w not in index:
                connect(w)
                low[v] = min(low[v], low[w])
            elif w in on_stack:
                low[v] = min(low[v], index[w])
        if low[v] == index[v]:
            component = []
            while True:
                w = stack.pop()
                on_stack.discard(w)
                component.append(w)
                if w == v:
                    break
            if len(component) > 1:
                found.append(sorted(component))

    for v in sorted(graph):
        if v not in index:
            connect(v)
    return found


def _package_of(module: str, known: dict[str, Path]) -> str:
    """A module's package; a top-level module of `vllm_delta` (cli, client, ...) counts as its own."""
    path = known[module]
    if path.name == "__init__.py" or module.count(".") == 1:
        return module
    return module.rsplit(".", 1)[0]


@pytest.fixture(scope="module")
def graph() -> dict[str, set[str]]:
    known = _files()
    return {m: _imports(m, p, known) for m, p in known.items()}


def test_no_import_cycle_between_files(graph: dict[str, set[str]]) -> None:
    assert _cycles(graph) == []


def test_no_import_cycle_between_packages(graph: dict[str, set[str]]) -> None:
    known = _files()
    packages: dict[str, set[str]] = {}
    for module, targets in graph.items():
        source = _package_of(module, known)
        for target in targets:
            into = _package_of(target, known)
            if into != source and not source.startswith(into + "."):  # a subpackage may use its parent
                packages.setdefault(source, set()).add(into)
    assert _cycles(packages) == []


def test_files_stay_small() -> None:
    sizes = {str(p.relative_to(ROOT)): len(p.read_text().splitlines()) for p in _files().values()}
    over = {f: n for f, n in sizes.items() if n > OVERSIZE.get(f, MAX_FILE_LINES)}
    assert over == {}, f"files over {MAX_FILE_LINES} lines (split them by job): {over}"
    assert set(OVERSIZE) <= set(sizes), "an OVERSIZE entry names a file that is gone: drop it"
    assert sum(sizes.values()) <= MAX_LIBRARY_LINES


def test_the_checker_sees_a_cycle_through_a_package_init() -> None:
    """The check itself can fail: a two-file cycle and one through `__init__` are both found."""
    graph = {"p": {"p.a"}, "p.a": {"p.b"}, "p.b": {"p"}, "q": {"r"}, "r": set()}
    assert _cycles(graph) == [["p", "p.a", "p.b"]]


def test_test_modules_have_distinct_names() -> None:
    """tests/ holds no packages, so two test files of one name break the whole suite's collection."""
    names = [p.name for p in (ROOT / "tests").rglob("test_*.py")]
    assert sorted({n for n in names if names.count(n) > 1}) == []

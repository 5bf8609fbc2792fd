"""The import layers of ddpd, read from the source with `ast` (lazy imports in functions included).

Between the top-level packages, the README's rules: `protocol` imports nothing of ddpd; `daemon`
and `worker` import `protocol` and never each other; `client` imports `protocol` only; `cli` goes
through `client`. Inside the daemon, each subpackage's own rule, the `May import:` line of its
`__init__` docstring (its `Never imports:` line must be the exact rest); the root's low modules
(config, layout, logs, logline, journald, notify) have theirs here, and `app` and `main` may import anything.
"""

from __future__ import annotations

import ast
import re
from collections.abc import Iterable
from graphlib import CycleError, TopologicalSorter
from pathlib import Path

import pytest

import ddpd

SRC = Path(ddpd.__file__).parent
DAEMON = SRC / "daemon"
SUBPACKAGES = sorted(p.parent.name for p in DAEMON.glob("*/__init__.py"))
TOP = {"protocol": set(), "daemon": {"protocol"}, "worker": {"protocol"}, "client": {"protocol"}, "cli": {"client"}}
ROOT_LOW = {"config": {"protocol", "logs"}, "logs": {"logline", "journald"}, "journald": {"logline"},
            "logline": set(), "notify": set(), "layout": set()}
ROOT_TOP = {"app", "main", "__main__", "daemon"}  # the process root (and the package itself): anything


def rule_lines(sub: str) -> tuple[set[str], set[str]]:
    """The units `sub` may import and those it says it never imports, from its `__init__` docstring."""
    doc = ast.get_docstring(ast.parse((DAEMON / sub / "__init__.py").read_text())) or ""
    found = {key: re.search(rf"^{key}: (.*)\.$", doc, re.MULTILINE) for key in ("May import", "Never imports")}
    missing = [key for key, m in found.items() if m is None]
    assert not missing, f"daemon/{sub}/__init__.py: its docstring has no line {missing[0]!r}: ..."
    may, never = ({name.strip() for name in m.group(1).split(",")} for m in found.values() if m is not None)
    return may, never


def rules() -> dict[str, set[str]]:
    """What each daemon unit may import of the daemon and protocol (None-free: every unit has a rule)."""
    out = {sub: rule_lines(sub)[0] for sub in SUBPACKAGES}
    out.update(ROOT_LOW)
    return out


def module_of(path: Path, src: Path) -> str:
    parts = list(path.relative_to(src.parent).with_suffix("").parts)
    return ".".join(parts[:-1] if parts[-1] == "__init__" else parts)


def imports(src: Path = SRC) -> set[tuple[str, str]]:
    """(importer, imported) for every import of a ddpd module, relative ones resolved."""
    edges: set[tuple[str, str]] = set()
    for path in src.rglob("*.py"):
        module = module_of(path, src)
        package = module if path.name == "__init__.py" else module.rpartition(".")[0]
        for node in ast.walk(ast.parse(path.read_text())):
            edges.update((module, target) for target in _targets(node, package))
    return {(a, b) for a, b in edges if b == "ddpd" or b.startswith("ddpd.")}


def _targets(node: ast.AST, package: str) -> Iterable[str]:
    if isinstance(node, ast.Import):
        return [alias.name for alias in node.names]
    if not isinstance(node, ast.ImportFrom):
        return []
    if not node.level:
        return [node.module or ""]
    base = ".".join(package.split(".")[: len(package.split(".")) - node.level + 1])
    if node.module:
        return [f"{base}.{node.module}"]
    return [f"{base}.{alias.name}" for alias in node.names]  # `from . import x`: x may be a module


def unit(module: str) -> tuple[str, str | None]:
    """(top-level package, daemon unit): ("daemon", "queue") for ddpd.daemon.queue.scheduler,
    ("daemon", "config") for ddpd.daemon.config, ("cli", None) for ddpd.cli.render, ("ddpd", None)."""
    parts = module.split(".")
    if len(parts) == 1 or parts[1] == "__version__":
        return "ddpd", None
    if parts[1] != "daemon":
        return parts[1], None
    return "daemon", parts[2] if len(parts) > 2 else "daemon"


def violations(edges: Iterable[tuple[str, str]], allowed: dict[str, set[str]]) -> list[str]:
    """Every import that breaks a rule, as "importer -> imported (why)"."""
    found = []
    for importer, imported in sorted(edges):
        (top, sub), (other_top, other_sub) = unit(importer), unit(imported)
        if other_top == "ddpd":
            ok = top != "protocol"  # the version
        elif top != other_top:
            ok = other_top in TOP[top]
        elif top != "daemon" or sub == other_sub or sub in ROOT_TOP:
            ok = True
        else:
            ok = other_sub in allowed.get(str(sub), set())
        if not ok:
            found.append(f"{importer} -> {imported} ({top}{'/' + sub if sub else ''} may not import "
                         f"{other_top}{'/' + other_sub if other_sub else ''})")
    return found


def test_each_subpackage_states_what_it_may_and_never_imports() -> None:
    assert {"attempt", "contain", "control", "gpu", "multinode", "pool", "queue", "ranklogs", "run",
            "store"} <= set(SUBPACKAGES)
    known = set(SUBPACKAGES) | set(ROOT_LOW) | {"protocol"}
    for sub in SUBPACKAGES:
        may, never = rule_lines(sub)
        assert may <= known, f"daemon/{sub}: unknown names {sorted(may - known)} in May import"
        assert never == (set(SUBPACKAGES) | {"app", "main"}) - may - {sub}, (
            f"daemon/{sub}: Never imports must be exactly the subpackages (and app, main) it may not import")


def test_the_subpackages_form_layers() -> None:
    graph = {sub: rule_lines(sub)[0] & set(SUBPACKAGES) for sub in SUBPACKAGES}
    try:
        order = list(TopologicalSorter(graph).static_order())
    except CycleError as exc:
        pytest.fail(f"the rules of the subpackages go round: {exc.args[1]}")
    assert order.index("contain") < order.index("attempt") < order.index("queue") < order.index("control")


def test_no_module_imports_what_its_layer_may_not() -> None:
    edges = imports()
    assert len(edges) > 300  # the walk found the imports (a broken walk would find nothing to break)
    assert violations(edges, rules()) == []


def test_a_broken_rule_is_named() -> None:
    planted = {
        ("ddpd.daemon.store.journal", "ddpd.daemon.queue.scheduler"),  # storage reaching up to scheduling
        ("ddpd.daemon.ranklogs.keeper", "ddpd.daemon.attempt.ranks"),  # the cycle broken by a Protocol
        ("ddpd.daemon.multinode.agentproc", "ddpd.daemon.attempt.launch"),  # even lazily, in a function
        ("ddpd.daemon.contain.procs", "ddpd.daemon.logs"),  # a low root module the rule does not list
        ("ddpd.protocol.spec", "ddpd.daemon.config"),
        ("ddpd.protocol.spec", "ddpd"),
        ("ddpd.worker.loop", "ddpd.daemon.gpu.gpus"),
        ("ddpd.cli.render", "ddpd.protocol.control"),  # cli goes through the client
        ("ddpd.client.aio", "ddpd.daemon.control.handlers"),
    }
    fine = {("ddpd.daemon.queue.scheduler", "ddpd.daemon.attempt.attempt"), ("ddpd.daemon.app", "ddpd.daemon.control"),
            ("ddpd.daemon.control.server", "ddpd"), ("ddpd.worker.bootstrap", "ddpd.protocol.channel"),
            ("ddpd.daemon.run.rendezvous", "ddpd.daemon.pool.channel"), ("ddpd.cli.render", "ddpd.client")}
    found = violations(planted | fine, rules())
    assert len(found) == len(planted) and {f.split(" ")[0] for f in found} == {a for a, _ in planted}
    assert ("ddpd.daemon.store.journal -> ddpd.daemon.queue.scheduler (daemon/store may not import daemon/queue)"
            in found)


def test_lazy_and_relative_imports_are_read(tmp_path: Path) -> None:
    pkg = tmp_path / "ddpd" / "daemon" / "store"
    pkg.mkdir(parents=True)
    (pkg / "__init__.py").write_text("")
    (pkg / "journal.py").write_text("def f():\n    from ..queue import scheduler\n    from . import bus\n")
    assert imports(tmp_path / "ddpd") == {("ddpd.daemon.store.journal", "ddpd.daemon.queue"),
                                          ("ddpd.daemon.store.journal", "ddpd.daemon.store.bus")}


def test_control_reaches_the_queue_through_its_facade_only() -> None:
    """Control and the metrics endpoint call `queue.facade` (its `Jobs`, the live config, the overview),
    never a part of the queue (its scheduler, table, runners)."""
    edges = imports()
    assert ("ddpd.daemon.control.handlers", "ddpd.daemon.queue.facade") in edges  # the walk sees control's imports
    assert queue_parts_reached(edges) == []
    planted = {("ddpd.daemon.control.handlers", "ddpd.daemon.queue.scheduler")}
    assert queue_parts_reached(planted) == ["ddpd.daemon.control.handlers -> ddpd.daemon.queue.scheduler"]


def queue_parts_reached(edges: Iterable[tuple[str, str]]) -> list[str]:
    return [f"{a} -> {b}" for a, b in sorted(edges) if unit(a) == ("daemon", "control")
            and unit(b) == ("daemon", "queue") and b != "ddpd.daemon.queue.facade"]

"""The import graph of ``hive_apps`` (issue 26, item 3): no cycles, pure modules reach no Ray, and
no module imports a layer above its own. And (issue 26, the injection of settings and metrics) the
process-wide things, the settings read from the environment and the metrics publisher, are made only
at composition roots (``ROOTS``), which pass them to what they build.

Read with ``ast``, never by importing. What counts as an import:

* every ``import`` / ``from ... import`` in the module, at top level *and* inside functions: a
  deferred import that closes a cycle is still a cycle, it only fails later;
* except those under ``if TYPE_CHECKING:``, which never run (annotations only);
* ``from pkg import name`` is an edge to ``pkg.name`` when that is a module, else to ``pkg``;
* importing ``a.b.c`` is not counted as importing the packages ``a`` and ``a.b`` (Python runs
  their ``__init__`` first, but an ``__init__`` that imports is an edge of its own).
"""

from __future__ import annotations

import ast
from functools import cache
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]
PACKAGE = "hive_apps"

# Lowest first: a module may import its own layer and those below it, never one above. A module
# belongs to the entry with the longest matching prefix (``routing.policy`` before ``routing``);
# every module must belong to one. Names are relative to ``hive_apps``.
LAYERS: list[tuple[str, tuple[str, ...]]] = [
    # weights: sources, manifests, caches and their fetch; imports nothing else of the hive
    ("weights", ("core.weights",)),
    # the vocabulary every app shares: names, settings, the deploy spec, the engine's wire contract
    ("shared", ("", "core", "core.names", "core.settings", "core.auth", "core.openai_errors", "serving.request_ids",
                "ops.serve_env", "core.vllm_args", "core.spec", "core.ports", "models", "serving.engine.protocol")),
    # what a node has: device samples, the GPU catalog and the driver floor (read by planning, the seam, the registry)
    ("devices", ("core.devices", "core.catalog", "core.drivers", "control.registry.monitor",
                 "control.registry.samples")),
    # pure core: profiles, vLLM's memory model, placement and sizing (control/planner.py is its Serve shell)
    ("planning", ("core.planning",)),
    # pure state and rules: the registry's ledger, records and transitions, the lifecycle rules, and
    # routing's rules (which replicas are live, replica choice, prompt splitting, allowed paths and media URLs)
    ("rules", ("core.state", "core.lifecycle", "core.history",
               "serving.routing.liveness", "serving.routing.policy", "serving.routing.split", "serving.routing.paths",
               "serving.routing.media", "serving.routing.prefix")),
    # the seam to Ray / Serve, and the metrics every Ray process publishes
    ("seam", ("control.cluster", "ops.metrics")),
    # serving: engine replicas, then the routers in front of them
    ("engine", ("serving.engine",)),
    ("routing", ("serving.routing",)),
    # the Serve applications and processes: each composes the layers below
    ("apps", ("control", "ops", "serving", "control.admin", "serving.gateway", "control.registry", "control.planner",
              "ops.monitor", "ops.quickstart")),
]

# Modules that must not reach Ray, directly or through anything they import (their docstrings say
# "Pure: no Ray"): unit tests and the planner's worker process run them without Ray. Every module of
# ``core`` is pure: the folder says so.
PURE = ("core", "control.registry.monitor", "control.registry.samples",
        "serving.routing.liveness", "serving.routing.policy", "serving.routing.split", "serving.routing.paths",
        "serving.routing.media", "serving.routing.prefix", "serving.engine.protocol")
PURE_EXCEPT: tuple[str, ...] = ()
# The planner also runs where vLLM is not installed (core/planning/profile/vllm_registry.py)
FORBIDDEN = {"ray": PURE, "vllm": ("core.planning",), "torch": ("core.planning",)}


# Where a process reads its settings (``get_settings()``) or makes its metrics publisher
# (``Publisher(...)``): its composition roots only. "module:function" (relative to ``hive_apps``)
# -> why it is a root. Everything else receives the settings, or the values it needs, and the
# publisher from its caller.
ROOTS: dict[str, dict[str, str]] = {
    "get_settings": {
        "control.admin.app:admin_app": "the admin's Serve ingress, built on its replica",
        "control.registry.deployment:Registry.__init__": "the registry's Serve constructor (tests pass settings)",
        "control.planner:Planner.__init__": "the planner's Serve constructor",
        "control.cluster:NodeFetcher.__init__": "a node's weight fetcher: a Ray actor reading its own node's environment",
        "serving.gateway.app:Gateway.__init__": "the gateway's Serve constructor",
        "serving.routing.router:Router.__init__": "a model router's Serve constructor",
        "serving.engine.base:EngineBase.__init__": "an engine replica's Serve constructor, on its node (tests pass settings)",
        "ops.quickstart:main": "the quickstart CLI",
    },
    "Publisher": {
        "control.registry.deployment:Registry.__init__": "the registry's Serve constructor (tests pass a publisher)",
        "serving.gateway.app:Gateway.__init__": "the gateway's Serve constructor",
        "serving.routing.router:Router.__init__": "a model router's Serve constructor",
        "serving.engine.base:EngineBase.__init__": "an engine replica's Serve constructor (tests pass a publisher)",
    },
}


def _calls_of(tree: ast.AST, names: set[str]) -> list[tuple[str, str, int]]:
    """(name called, the function it is called in as ``Class.method`` or ``<module>``, line) of every
    call of one of ``names``, by name or as an attribute (``settings.get_settings()``). A default
    argument or a decorator runs where its function is defined, so it counts there."""
    out: list[tuple[str, str, int]] = []

    def walk(node: ast.AST, scope: tuple[str, ...]) -> None:
        if isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef)):
            outer = [*node.decorator_list, *node.args.defaults, *(d for d in node.args.kw_defaults if d is not None)]
            for n in outer:
                walk(n, scope)
            for n in node.body:
                walk(n, (*scope, node.name))
            return
        if isinstance(node, ast.ClassDef):
            for n in node.decorator_list:
                walk(n, scope)
            for n in node.body:
                walk(n, (*scope, node.name))
            return
        if isinstance(node, ast.Call):
            f = node.func
            name = f.id if isinstance(f, ast.Name) else f.attr if isinstance(f, ast.Attribute) else None
            if name in names:
                out.append((name, ".".join(scope) or "<module>", node.lineno))
        for child in ast.iter_child_nodes(node):
            walk(child, scope)

    walk(tree, ())
    return out


def _modules() -> dict[str, Path]:
    out = {}
    for path in sorted((ROOT / PACKAGE).rglob("*.py")):
        parts = list(path.relative_to(ROOT).with_suffix("").parts)
        if parts[-1] == "__init__":
            parts.pop()
        out[".".join(parts)] = path
    return out


def _is_type_checking(node: ast.If) -> bool:
    t = node.test
    return (isinstance(t, ast.Name) and t.id == "TYPE_CHECKING") or \
        (isinstance(t, ast.Attribute) and t.attr == "TYPE_CHECKING")


def _import_nodes(tree: ast.AST):
    """Every import statement that can run: any depth, but not under ``if TYPE_CHECKING:``."""
    stack = [tree]
    while stack:
        node = stack.pop()
        if isinstance(node, (ast.Import, ast.ImportFrom)):
            yield node
        if isinstance(node, ast.If) and _is_type_checking(node):
            stack.extend(node.orelse)
            continue
        stack.extend(ast.iter_child_nodes(node))


@cache
def _graph() -> tuple[dict[str, set[str]], dict[str, set[str]]]:
    """(module -> the hive modules it imports, module -> the top-level outside packages it imports)."""
    mods = _modules()

    def owner(name: str) -> str | None:
        while name and name not in mods:
            name = name.rpartition(".")[0]
        return name or None

    edges: dict[str, set[str]] = {}
    external: dict[str, set[str]] = {}
    for mod, path in mods.items():
        package = mod if path.name == "__init__.py" else mod.rpartition(".")[0]
        inner, outer = set(), set()
        for node in _import_nodes(ast.parse(path.read_text(), str(path))):
            if isinstance(node, ast.Import):
                targets = [a.name for a in node.names]
            else:
                base = node.module or ""
                if node.level:
                    up = package.split(".")[: len(package.split(".")) - node.level + 1]
                    base = ".".join(up + ([base] if base else []))
                targets = [f"{base}.{a.name}" if f"{base}.{a.name}" in mods else base for a in node.names]
            for target in targets:
                if target == PACKAGE or target.startswith(PACKAGE + "."):
                    if (hit := owner(target)) and hit != mod:
                        inner.add(hit)
                else:
                    outer.add(target.split(".")[0])
        edges[mod], external[mod] = inner, outer
    return edges, external


def _short(mod: str) -> str:
    return mod.removeprefix(PACKAGE).removeprefix(".")


def _cycles(edges: dict[str, set[str]]) -> list[tuple[list[str], set[str]]]:
    """One cycle through each strongly connected component of more than one module (Tarjan), and
    the component: breaking the cycle shown may leave another in the same component."""
    index: dict[str, int] = {}
    low: dict[str, int] = {}
    stack: list[str] = []
    on_stack: set[str] = set()
    components: list[set[str]] = []

    def visit(v: str) -> None:
        index[v] = low[v] = len(index)
        stack.append(v)
        on_stack.add(v)
        for w in sorted(edges[v]):
            if w not in index:
                visit(w)
                low[v] = min(low[v], low[w])
            elif w in on_stack:
                low[v] = min(low[v], index[w])
        if low[v] == index[v]:
            comp = set()
            while True:
                w = stack.pop()
                on_stack.discard(w)
                comp.add(w)
                if w == v:
                    break
            if len(comp) > 1:
                components.append(comp)

    for v in sorted(edges):
        if v not in index:
            visit(v)
    out = []
    for comp in components:  # shortest way back to the component's first module, by BFS
        start = min(comp)
        paths = {start: [start]}
        queue = [start]
        while queue:
            v = queue.pop(0)
            for w in sorted(edges[v] & comp):
                if w == start:
                    out.append((paths[v] + [start], comp))
                    queue = []
                    break
                if w not in paths:
                    paths[w] = paths[v] + [w]
                    queue.append(w)
    return out


def _matches(mod: str, prefixes: tuple[str, ...]) -> int:
    """Length of the longest prefix (relative to the package) that ``mod`` falls under; -1: none."""
    rel = _short(mod)
    best = -1
    for p in prefixes:
        if rel == p or (p and rel.startswith(p + ".")) or (not p and not rel):
            best = max(best, len(p))
    return best


def _layer_of(mod: str) -> int | None:
    scored = [(_matches(mod, prefixes), i) for i, (_, prefixes) in enumerate(LAYERS)]
    length, layer = max(scored)
    return layer if length >= 0 else None


def test_the_graph_is_read():
    edges, external = _graph()
    assert len(edges) > 50
    assert f"{PACKAGE}.core.planning.planner" in edges[f"{PACKAGE}.control.planner"]
    assert "ray" in external[f"{PACKAGE}.control.cluster"]  # deferred, inside methods


def test_no_import_cycles():
    cycles = _cycles(_graph()[0])
    assert not cycles, "import cycles:\n" + "\n".join(
        " -> ".join(map(_short, c)) + f"  (a cycle group of {len(comp)}: {', '.join(sorted(map(_short, comp)))})"
        for c, comp in cycles)


def test_pure_modules_reach_no_ray():
    """Directly or through any hive module they import (the path is in the message)."""
    edges, external = _graph()
    problems = []
    for package, roots in FORBIDDEN.items():
        for mod in sorted(edges):
            if _matches(mod, roots) < 0 or _matches(mod, PURE_EXCEPT) >= 0:
                continue
            paths = {mod: [mod]}
            queue = [mod]
            while queue:
                v = queue.pop(0)
                if package in external[v]:
                    problems.append(" -> ".join(map(_short, paths[v])) + f" imports {package}")
                    break
                for w in sorted(edges[v]):
                    if w not in paths:
                        paths[w] = paths[v] + [w]
                        queue.append(w)
    assert not problems, "pure modules that reach a forbidden package:\n" + "\n".join(problems)


def test_every_module_has_a_layer():
    missing = [_short(m) for m in _graph()[0] if _layer_of(m) is None]
    assert not missing, f"add these modules to LAYERS in {__file__}: {missing}"


def test_no_module_imports_a_layer_above_its_own():
    edges, _ = _graph()
    up = []
    for mod, targets in sorted(edges.items()):
        here = _layer_of(mod)
        for target in sorted(targets):
            there = _layer_of(target)
            if here is not None and there is not None and there > here:
                up.append(f"{_short(mod)} ({LAYERS[here][0]}) imports {_short(target)} ({LAYERS[there][0]})")
    assert not up, "upward imports (see LAYERS):\n" + "\n".join(up)


def test_the_checks_catch_what_they_are_for(tmp_path):
    """The cycle finder reports a deferred cycle with its path; the layer lookup takes the longest prefix."""
    assert _cycles({"a": {"b"}, "b": {"c"}, "c": {"a"}, "d": {"a"}}) == [(["a", "b", "c", "a"], {"a", "b", "c"})]
    assert _cycles({"a": {"b"}, "b": set()}) == []
    tree = ast.parse("from typing import TYPE_CHECKING\nif TYPE_CHECKING:\n    import x\nelse:\n    import y\n"
                     "def f():\n    import z\n")
    names = {a.name for n in _import_nodes(tree) if isinstance(n, ast.Import) for a in n.names}
    assert names == {"y", "z"}
    layers = dict((name, i) for i, (name, _) in enumerate(LAYERS))
    assert _layer_of(f"{PACKAGE}.serving.routing.policy") == layers["rules"]
    assert _layer_of(f"{PACKAGE}.serving.routing.router") == layers["routing"]
    assert _layer_of(f"{PACKAGE}.control.planner") == layers["apps"]


def test_core_imports_nothing_above_it():
    """The folders show the layers: ``core`` (pure logic and the shared vocabulary) imports no module
    of ``control``, ``serving`` or ``ops``; they build on it."""
    edges, _ = _graph()
    core = f"{PACKAGE}.core"
    above = [f"{_short(mod)} imports {_short(target)}" for mod, targets in sorted(edges.items())
             if mod == core or mod.startswith(core + ".") for target in sorted(targets)
             if target.split(".")[1] in ("control", "serving", "ops")]
    assert not above, "core reaches up:\n" + "\n".join(above)


def test_settings_and_the_metrics_publisher_are_made_only_at_composition_roots():
    """``get_settings()`` and ``Publisher(...)`` are called only by the functions ``ROOTS`` lists, and
    each listed root still calls it (so the list stays the list of roots)."""
    found: dict[str, set[str]] = {name: set() for name in ROOTS}
    problems = []
    for mod, path in _modules().items():
        for name, where, line in _calls_of(ast.parse(path.read_text(), str(path)), set(ROOTS)):
            site = f"{_short(mod)}:{where}"
            found[name].add(site)
            if site not in ROOTS[name]:
                problems.append(f"{path.relative_to(ROOT)}:{line}: {name}() in {where}, not a composition root; take "
                                "it from the caller (or add the root to ROOTS in tests/unit/test_layering.py)")
    stale = [f"{name}: {site}" for name, sites in ROOTS.items() for site in sites if site not in found[name]]
    assert not problems, "\n".join(problems)
    assert not stale, f"listed in ROOTS but no longer calls it: {stale}"


def test_the_root_check_sees_calls_where_they_run():
    tree = ast.parse("from x import get_settings\n"
                     "A = get_settings()\n"
                     "def f(s=settings.get_settings()):\n"
                     "    return get_settings()\n"
                     "class C:\n"
                     "    async def m(self):\n"
                     "        def inner():\n"
                     "            return Publisher(backend=1)\n"
                     "        return get_settings\n")  # a reference, not a call
    assert _calls_of(tree, {"get_settings", "Publisher"}) == [
        ("get_settings", "<module>", 2), ("get_settings", "<module>", 3), ("get_settings", "f", 4),
        ("Publisher", "C.m.inner", 8)]

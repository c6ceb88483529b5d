"""tools/import_lint.py on a tiny fake project: what it must find and what it must not.

Standard library only (no engine, no model): the fake tree is written to ``tmp_path``.
"""

from __future__ import annotations

import importlib.util
import sys
from pathlib import Path
from textwrap import dedent

import pytest

TOOL = Path(__file__).resolve().parent.parent / "tools" / "import_lint.py"


@pytest.fixture(scope="module")
def import_lint():
    spec = importlib.util.spec_from_file_location("import_lint", TOOL)
    assert spec is not None and spec.loader is not None
    module = importlib.util.module_from_spec(spec)
    sys.modules[spec.name] = module  # dataclasses look their module up
    try:
        spec.loader.exec_module(module)
        yield module
    finally:
        sys.modules.pop(spec.name, None)


def _write(root: Path, files: dict[str, str]) -> None:
    for rel, text in files.items():
        path = root / rel
        path.parent.mkdir(parents=True, exist_ok=True)
        path.write_text(dedent(text), encoding="utf-8")


PKG = "packages/dist-a/src/spyre_inference/a"
OTHER = "packages/dist-b/src/spyre_inference/b"

FAKE = {
    # A plain cycle: x <-> y at module level.
    f"{PKG}/__init__.py": "from spyre_inference.a._version import __version__\n",
    f"{PKG}/_version.py": "__version__ = '0'\n",
    f"{PKG}/x.py": "from spyre_inference.a import y\n",
    f"{PKG}/y.py": "from . import x\n",
    # A cycle closed by a lazy import (inside a function), relative imports.
    f"{PKG}/lazy1.py": "from .lazy2 import f\n",
    f"{PKG}/lazy2.py": """\
        def f():
            from spyre_inference.a.lazy1 import g
            return g
        """,
    # Only a TYPE_CHECKING import closes this one: not a cycle.
    f"{PKG}/tc1.py": "import spyre_inference.a.tc2\n",
    f"{PKG}/tc2.py": """\
        from typing import TYPE_CHECKING

        if TYPE_CHECKING:
            from spyre_inference.a.tc1 import T
        else:
            import os
        """,
    # Private names: a helper, a re-export, a module attribute, a private module.
    f"{PKG}/helpers.py": "def _helper(): ...\n_TABLE = {}\ndef public(): ...\n",
    f"{PKG}/_impl.py": "def thing(): ...\n",
    f"{PKG}/user.py": """\
        from spyre_inference.a._impl import thing
        from spyre_inference.a.helpers import _helper, public
        from spyre_inference.a import helpers as h

        VALUE = h._TABLE
        OK = h.public, h.__name__
        """,
    f"{PKG}/reexport.py": "from spyre_inference.a.helpers import _helper as _helper\n",
    f"{OTHER}/__init__.py": "",
    f"{OTHER}/user.py": """\
        import spyre_inference.a.reexport

        def run():
            from spyre_inference.a._impl import thing
            return spyre_inference.a.reexport._helper, thing
        """,
}


def test_findings_on_a_fake_tree(import_lint, tmp_path: Path) -> None:
    _write(tmp_path, FAKE)
    cycles, findings, _ = import_lint.lint(tmp_path)

    chains = sorted(tuple(e.src.rpartition(".")[2] for e in cycle) for cycle in cycles)
    assert chains == [("lazy1", "lazy2"), ("x", "y")]
    lazy = {e.src.rpartition(".")[2]: e.lazy for cycle in cycles for e in cycle}
    assert lazy == {"x": False, "y": False, "lazy1": False, "lazy2": True}

    got = sorted((f.path.name, f.path.parent.name, f.line, f.message) for f in findings)
    assert got == [
        ("reexport.py", "a", 1, "private name _helper of spyre_inference.a.helpers"),
        ("user.py", "a", 2, "private name _helper of spyre_inference.a.helpers"),
        ("user.py", "a", 5, "private name _TABLE of spyre_inference.a.helpers"),
        (
            "user.py",
            "b",
            4,
            "private module spyre_inference.a._impl imported from outside spyre_inference.a",
        ),
        (
            "user.py",
            "b",
            5,
            "private name _helper of spyre_inference.a.reexport "
            "(defined in spyre_inference.a.helpers)",
        ),
    ]
    assert import_lint.main([str(tmp_path)]) == 1


def test_clean_tree_passes(import_lint, tmp_path: Path, capsys) -> None:
    _write(tmp_path, {k: v for k, v in FAKE.items() if k.endswith(("tc1.py", "tc2.py"))})
    assert import_lint.main([str(tmp_path)]) == 0
    assert capsys.readouterr().out.strip().endswith("0 cycles, 0 private imports: ok")

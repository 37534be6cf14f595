"""Every research notebook in notebooks/ runs top to bottom, its asserts included.

Each notebook states its key claim in an ``assert`` cell, so executing it is a
regression test. It runs from an in-memory copy (outputs never reach the
repository) with a temporary working directory, in a kernel started from this
interpreter (so a fresh CI virtualenv tests its own install, whatever kernels
are registered elsewhere), with matplotlib's non-interactive Agg backend.

With ``JAXACCUM_EXECUTED_NOTEBOOKS=DIR`` set, each executed notebook (outputs
included, the inserted interpreter check left out) is written to ``DIR``, and
the docs build renders those copies instead of executing the notebooks again
(``docs/_site_hooks.py``): CI executes each notebook once per instruction set.
"""

import json
import os
import pathlib
import re
import sys
import time

import nbformat
import pytest
from jupyter_client.kernelspec import KernelSpecManager
from jupyter_client.manager import AsyncKernelManager
from nbclient import NotebookClient
from nbclient.exceptions import CellExecutionError, CellTimeoutError
from xla_level import USER_XLA_FLAGS

NOTEBOOK_DIR = pathlib.Path(__file__).parent.parent / "notebooks"
NOTEBOOKS = sorted(NOTEBOOK_DIR.glob("*.ipynb"))
# Each notebook takes ~10-30 s on 2 CPU cores; the rest is headroom for slow CI.
NOTEBOOK_TIMEOUT_S = 180
KERNEL_NAME = "jaxaccum-test-python"
ANSI_ESCAPE = re.compile(r"\x1b\[[0-9;]*m")  # colours in IPython tracebacks


def _kernel_manager(kernel_dir: pathlib.Path) -> AsyncKernelManager:
    """A manager for a kernel that runs this interpreter, not a registered one."""
    spec_dir = kernel_dir / KERNEL_NAME
    spec_dir.mkdir(parents=True)
    spec = {
        "argv": [sys.executable, "-m", "ipykernel_launcher", "-f", "{connection_file}"],
        "display_name": f"jaxaccum tests ({sys.executable})",
        "language": "python",
    }
    (spec_dir / "kernel.json").write_text(json.dumps(spec))
    specs = KernelSpecManager(kernel_dirs=[str(kernel_dir)], ensure_native_kernel=False)
    return AsyncKernelManager(kernel_name=KERNEL_NAME, kernel_spec_manager=specs)


def test_notebooks_exist_and_are_stripped():
    assert NOTEBOOKS, f"no notebooks in {NOTEBOOK_DIR}"
    for path in NOTEBOOKS:
        notebook = nbformat.read(path, as_version=4)
        nbformat.validate(notebook)
        dirty = [
            index
            for index, cell in enumerate(notebook.cells)
            if cell.cell_type == "code" and (cell.outputs or cell.execution_count)
        ]
        assert not dirty, (
            f"{path.name}: code cells {dirty} have outputs or execution counts; "
            "commit notebooks stripped (e.g. jupyter nbconvert --clear-output)."
        )


def _keep_executed_copy(name: str, notebook: nbformat.NotebookNode) -> None:
    """Writes the executed notebook where the docs build reads it, if asked."""
    directory = os.environ.get("JAXACCUM_EXECUTED_NOTEBOOKS")
    if not directory:
        return
    notebook.cells.pop(0)  # the interpreter check this test inserted: renumber
    for cell in notebook.cells:
        if cell.cell_type == "code" and cell.execution_count:
            cell.execution_count -= 1
            for output in cell.outputs:
                if output.get("execution_count"):
                    output.execution_count -= 1
    pathlib.Path(directory).mkdir(parents=True, exist_ok=True)
    nbformat.write(notebook, pathlib.Path(directory) / name)


@pytest.mark.timeout(NOTEBOOK_TIMEOUT_S + 60)
@pytest.mark.parametrize("path", NOTEBOOKS, ids=[path.stem for path in NOTEBOOKS])
def test_notebook_runs(path, tmp_path, monkeypatch):
    monkeypatch.setenv("MPLBACKEND", "Agg")
    # The kernel compiles at XLA's default level, not the suite's -O0
    # (tests/conftest.py): the docs show what it prints, timings included.
    if USER_XLA_FLAGS in os.environ:
        monkeypatch.setenv("XLA_FLAGS", os.environ[USER_XLA_FLAGS])
    notebook = nbformat.read(path, as_version=4)
    # Fail early and clearly if the kernel is not this interpreter's environment.
    notebook.cells.insert(
        0,
        nbformat.v4.new_code_cell(
            f"import sys\nassert sys.prefix == {sys.prefix!r}, sys.executable"
        ),
    )
    workdir = tmp_path / "workdir"
    workdir.mkdir()
    deadline = time.monotonic() + NOTEBOOK_TIMEOUT_S
    client = NotebookClient(
        notebook,
        km=_kernel_manager(tmp_path / "kernels"),
        # The whole notebook shares one deadline: each cell gets what is left.
        timeout_func=lambda cell: max(1, int(deadline - time.monotonic())),
        resources={"metadata": {"path": str(workdir)}},
    )
    start = time.monotonic()
    try:
        client.execute()
    except CellTimeoutError as error:
        failure = f"{path.name} ran past its {NOTEBOOK_TIMEOUT_S} s budget:\n{error}"
    except CellExecutionError as error:
        elapsed = time.monotonic() - start
        failure = f"{path.name} failed after {elapsed:.1f} s:\n{error}"
    else:
        _keep_executed_copy(path.name, notebook)
        return
    # Outside the except blocks, so the report holds the cell's error once.
    pytest.fail(ANSI_ESCAPE.sub("", failure), pytrace=False)

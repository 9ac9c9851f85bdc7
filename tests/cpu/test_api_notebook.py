"""notebooks/quickstart.ipynb runs top to bottom (nbclient), joining the session's Ray."""

from __future__ import annotations

from pathlib import Path

import pytest

NOTEBOOK = Path(__file__).parents[2] / "notebooks" / "quickstart.ipynb"


@pytest.mark.slow
def test_quickstart_notebook_runs(ray_local, tiny_model, tmp_path, monkeypatch):
    import nbformat
    from nbclient import NotebookClient

    # The notebook reuses the session's checkpoint folder and joins the session's Ray; it puts
    # model and data on the storage every node reads (here a local folder standing for a mount).
    monkeypatch.setenv("PREFIXFLOW_DEMO_DIR", str(tiny_model.parent))
    monkeypatch.setenv("PREFIXFLOW_SHARED_DIR", str(tmp_path / "shared"))
    monkeypatch.setenv("RAY_ADDRESS", ray_local.get_runtime_context().gcs_address)
    nb = nbformat.read(NOTEBOOK, as_version=4)
    # startup_timeout: a kernel on a busy 2-core machine took over nbclient's default 60 s to start.
    resources = {"metadata": {"path": str(tmp_path)}}
    NotebookClient(nb, timeout=300, startup_timeout=180, kernel_name="python3", resources=resources).execute()
    outputs = [o for cell in nb.cells if cell.cell_type == "code" for o in cell.get("outputs", [])]
    assert not [o for o in outputs if o.get("output_type") == "error"]
    assert any("image/png" in o.get("data", {}) for o in outputs)  # the plots were drawn
    text = "".join(o.get("text", "") for o in outputs)
    assert "token_saving_ratio" in text and "engine steps" in text
    assert (tmp_path / "shared" / "tiny-llama" / "config.json").exists()
    assert f"{tmp_path / 'shared'}/tiny-llama" in text  # the model the engines loaded
    # The cluster examples are shown, not run (the test stays offline).
    shown = "".join(c.source for c in nb.cells if c.cell_type == "markdown")
    assert "setup_ray_cluster(" in shown and "anyscale job submit" in shown

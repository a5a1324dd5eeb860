import json
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parents[1]
DEMO_DATA = REPO / "polyalign" / "demo_data"
FIXTURES = REPO / "tests" / "fixtures"
SHARED_DATA = REPO.parent / "shared" / "data"
SCHEME = REPO / "buckets" / "polyalign.yaml"


def write_config(path: Path, sources: list[dict], **options) -> Path:
    """A data config next to its inputs, using the project's bucket scheme."""
    import yaml

    config = {"scheme": str(SCHEME), "sources": sources, **options}
    path.write_text(yaml.safe_dump(config, allow_unicode=True), encoding="utf-8")
    return path


def read_jsonl(path: Path) -> list[dict]:
    return [json.loads(line) for line in path.read_text(encoding="utf-8").splitlines() if line.strip()]


@pytest.fixture(scope="session")
def demo_run(tmp_path_factory):
    """prepare + stats on the bundled demo data, once per session."""
    from polyalign.data.prepare import prepare
    from polyalign.reports.stats import compute_stats

    run = tmp_path_factory.mktemp("demo_run")
    manifest = prepare(REPO / "configs" / "data" / "demo.yaml", run, progress=False)
    stats = compute_stats(run, progress=False)
    return run, manifest, stats

"""cluster.yaml is checked against the cluster-config schema shipped inside the ray package."""

from pathlib import Path

import yaml
from ray.autoscaler._private.util import prepare_config, validate_config

ROOT = Path(__file__).resolve().parents[2]


def test_cluster_yaml_matches_rays_schema():
    config = yaml.safe_load((ROOT / "cluster.yaml").read_text())
    # As `ray up` sees it, merged with the provider's defaults; jsonschema.ValidationError names the offending path.
    validate_config(prepare_config(config))
    workers = config["available_node_types"]["gpu_worker"]
    assert workers["min_workers"] >= 2  # the scale and prod pairs are planned for two 8-GPU nodes
    assert any("pip install" in c and "-e" in c for c in config["setup_commands"])  # installs this project
    assert all("export " not in c for c in config["setup_commands"])  # job env belongs in runtime_env

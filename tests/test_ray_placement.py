"""The Ray launcher's placement file and flags, which need no Ray; and the default path imports no Ray."""

from __future__ import annotations

import json
import subprocess
import sys

import pytest

from kvflow.cli.main import main
from kvflow.config import ClusterConfig, EngineConfig
from kvflow.controller.ray_launcher import Placement, RayConfig, RayLauncher, StagePlacement


def test_placement_file_round_trip(tmp_path):
    d = {"version": 1, "strategy": "STRICT_SPREAD",
         "stages": {"prompt-0": {"node_ip": "10.0.0.5"}, "token-0": {"node_id": "ab12"},
                    "token-1": {"labels": {"zone": "b"}, "resources": {"fast_nic": 0.01}}}}
    path = tmp_path / "plan.json"
    path.write_text(json.dumps(d))
    p = Placement.load(path)
    assert p.strategy == "STRICT_SPREAD"
    assert p.stages["prompt-0"].bundle_resources == {"node:10.0.0.5": 0.001} and p.stages["prompt-0"].label_selector == {}
    assert p.stages["token-0"].bundle_resources == {} and p.stages["token-0"].label_selector == {"ray.io/node-id": "ab12"}
    assert p.stages["token-1"].bundle_resources == {"fast_nic": 0.01} and p.stages["token-1"].label_selector == {"zone": "b"}
    assert p.to_dict() == d
    assert Placement.from_dict({}) == Placement()
    assert RayConfig(placement=p).placement_strategy == "STRICT_SPREAD"
    assert RayConfig(strategy="PACK", placement=p).placement_strategy == "PACK"  # the flag wins
    assert RayConfig().placement_strategy == "PACK"


@pytest.mark.parametrize("d, match", [
    ({"stages": {"token-0": {"node": "x"}}}, "expected an object with keys"),
    ({"stages": ["token-0"]}, "must map stage names"),
    ({"strategy": "ANYWHERE"}, "strategy must be one of"),
    ({"version": 2}, "version 2 is not supported"),
    ({"placement": {}}, "unknown placement keys"),
    ({"stages": {"token-0": {"resources": {"CPU": 2}}}}, "CPU is set from the cluster config"),
    ({"stages": {"token-0": {"resources": {"gpu_box": 0}}}}, "positive amounts"),
    ({"stages": {"token-0": {"node_ip": ""}}}, "non-empty string"),
    ({"stages": {"token-0": {"labels": {"zone": 1}}}}, "labels must map strings"),
    ([], "a JSON object"),
])
def test_bad_placements_are_rejected_with_a_reason(d, match):
    with pytest.raises(ValueError, match=match):
        Placement.from_dict(d)


def test_a_placement_naming_a_stage_the_layout_lacks_is_rejected(tiny_ckpt_dir):
    cfg = ClusterConfig(engine=EngineConfig(model=str(tiny_ckpt_dir), num_kv_blocks=16), mode="disaggregated")
    assert cfg.stage_names() == ["prompt-0", "token-0"]
    with pytest.raises(ValueError, match=r"stages \['colocated-1'\] that this layout does not have"):
        RayLauncher(cfg, RayConfig(placement=Placement({"colocated-1": StagePlacement(node_ip="10.0.0.5")})))


@pytest.mark.parametrize("argv, match", [
    (["--mode", "colocated", "--plan", "p.json"], "--plan need --launcher ray"),
    (["--mode", "colocated", "--ray-address", "auto", "--placement-strategy", "PACK"],
     "--ray-address, --placement-strategy need --launcher ray"),
    (["--launcher", "ray"], "--launcher ray needs --mode colocated or disaggregated"),
    (["--mode", "colocated", "--launcher", "ray", "--external-workers"], "exclude each other"),
])
def test_serve_rejects_ray_flags_out_of_place(argv, match, capsys):
    assert main(["serve", *argv]) == 2
    assert match in capsys.readouterr().err


def test_the_default_path_imports_no_ray():
    code = ("import sys\n"
            "from kvflow.cli.main import build_parser\n"
            "from kvflow.controller.controller import Controller\n"
            "from kvflow.controller import ray_launcher\n"  # the module itself imports Ray only when asked
            "args = build_parser().parse_args(['serve', '--mode', 'colocated'])\n"
            "assert args.launcher == 'subprocess', args.launcher\n"
            "assert 'ray' not in sys.modules, 'ray was imported'\n")
    subprocess.run([sys.executable, "-c", code], check=True, timeout=120)

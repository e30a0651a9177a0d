"""The hardware catalog, user spec files and their errors, and where mesh axes land."""

import json

import pytest

from partitioner.cost import CATALOG, HardwareError, Placement, load_hardware
from partitioner.mesh import Mesh


def test_catalog_has_the_issue_s_hardware():
  assert {"tpu-v3", "tpu-v4", "tpu-v5p", "a100-40gb", "a100-80gb", "h100"} <= set(CATALOG)
  h100 = load_hardware("H100")
  assert h100.flops("bfloat16") == 989e12 and h100.node_size == 8
  assert load_hardware("a100") is CATALOG["a100-80gb"]
  assert h100.intra.bandwidth > 5 * h100.inter.bandwidth
  h200 = CATALOG["h200"]     # the H100's compute with more and faster HBM
  assert h200.peak_flops == h100.peak_flops and h200.hbm_bandwidth > 1.4 * h100.hbm_bandwidth
  assert h200.hbm_bytes > 1.6 * h100.hbm_bytes


@pytest.mark.parametrize("suffix", [".yaml", ".json"])
def test_user_spec_files_round_trip(tmp_path, suffix):
  import yaml
  spec = CATALOG["h100"].to_dict()
  spec.update(name="my-gpu", node_size=4)
  path = tmp_path / ("gpu" + suffix)
  path.write_text(yaml.safe_dump(spec) if suffix == ".yaml" else json.dumps(spec))
  hw = load_hardware(str(path))
  assert hw.name == "my-gpu" and hw.node_size == 4 and hw.intra == CATALOG["h100"].intra


@pytest.mark.parametrize("content,message", [
    ("name: x\n", "missing field(s) description, peak_flops"),
    ("[1, 2]\n", "expected a mapping of fields"),
    ("name: [unclosed\n", "not valid YAML"),
    (None, "unknown field(s) colour"),
    ("hbm: 3\n", "unknown field(s) hbm"),
])
def test_malformed_specs_are_one_line_errors(tmp_path, content, message):
  if content is None:
    spec = CATALOG["h100"].to_dict()
    spec["colour"] = "green"
    import yaml
    content = yaml.safe_dump(spec)
  path = tmp_path / "bad.yaml"
  path.write_text(content)
  with pytest.raises(HardwareError) as e:
    load_hardware(str(path))
  assert message in str(e.value) and "\n" not in str(e.value)


def test_bad_values_and_names():
  spec = CATALOG["h100"].to_dict()
  spec["hbm_bandwidth"] = "fast"
  from partitioner.cost.hardware import Hardware
  with pytest.raises(HardwareError, match="hbm_bandwidth must be a number"):
    Hardware.from_dict(spec)
  spec = CATALOG["h100"].to_dict()
  spec["combine_threshold_bytes"] = -1
  with pytest.raises(HardwareError, match="combine_threshold_bytes must be positive"):
    Hardware.from_dict(spec)
  spec["combine_threshold_bytes"] = 0      # a machine whose collectives never combine
  spec["kernel_launch_s"] = -1e-6
  with pytest.raises(HardwareError, match="kernel_launch_s must be positive"):
    Hardware.from_dict(spec)
  spec["kernel_launch_s"] = 0              # a spec without launch costs
  assert Hardware.from_dict(spec).combine_threshold_bytes == 0
  assert CATALOG["h100"].combine_threshold_bytes == 30 << 20
  assert CATALOG["cpu"].combine_threshold_bytes == 0       # XLA:CPU has no combiner
  separate = CATALOG["h100"].combining(0)
  assert separate.combine_threshold_bytes == 0 and separate.name != "h100"
  assert separate.peak_flops == CATALOG["h100"].peak_flops
  roofline = CATALOG["h100"].launching(0.0)
  assert roofline.kernel_launch_s == 0 and roofline.name != "h100"
  assert roofline.combine_threshold_bytes == CATALOG["h100"].combine_threshold_bytes
  with pytest.raises(HardwareError, match="unknown hardware 'h900'; catalog: tpu-v3"):
    load_hardware("h900")
  with pytest.raises(HardwareError, match="no such hardware spec file"):
    load_hardware("missing.yaml")


def test_axes_land_inside_or_across_nodes():
  mesh = Mesh({"batch": 8, "model": 8})
  h100 = CATALOG["h100"]
  default = Placement(mesh, h100)
  assert default.describe() == {"batch": "inter", "model": "intra"}
  swapped = Placement(mesh, h100, ["model", "batch"])
  assert swapped.describe() == {"batch": "intra", "model": "inter"}
  wide = Placement(Mesh({"data": 32}), h100)
  assert wide.group(("data",)) == (32, 8, 4) and wide.level("data") == "both"


def test_thousands_of_devices_need_no_devices():
  mesh = Mesh({"data": 64, "fsdp": 8, "model": 8})
  p = Placement(mesh, CATALOG["tpu-v4"])
  assert p.group(("data", "fsdp", "model")) == (4096, 4096, 1)
  p = Placement(mesh, CATALOG["h100"])
  assert p.group(("data", "fsdp")) == (512, 1, 512)


def test_a_bad_order_is_an_error():
  from partitioner.errors import MeshError
  with pytest.raises(MeshError, match="must name each mesh axis"):
    Placement(Mesh({"a": 2, "b": 4}), CATALOG["h100"], ["a", "c"])

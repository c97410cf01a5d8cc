"""The documentation's code examples run as written: each is taken from README.md or docs/*.md,
given the names it leaves to the reader (a model, a loader, data), and run for real; and its links
lead somewhere."""

from __future__ import annotations

import hashlib
import json
import os
import re
import subprocess
import textwrap
from collections.abc import Iterator

import h5py
import numpy as np
import torch
import yaml

from conftest import BIN, REPO, TEST_CONFIG, snakemake

README = (REPO / "README.md").read_text()
# README.md is the entry point; the reference for each tool lives in docs/ (examples included).
DOCS = [REPO / "README.md", *sorted((REPO / "docs").glob("*.md")), REPO / "reports" / "README.md"]


def example(lang: str, marker: str) -> str:
    """The one ```lang block of README.md and docs/*.md that contains ``marker``."""
    text = "\n".join(path.read_text() for path in DOCS)
    blocks = [b for b in re.findall(rf"```{lang}\n(.*?)```", text, re.S) if marker in b]
    assert len(blocks) == 1, f"expected one {lang} example containing {marker!r}, found {len(blocks)}"
    return blocks[0]


def run(cmd, cwd, **kwargs) -> subprocess.CompletedProcess:
    env = {**os.environ, "PATH": f"{BIN}{os.pathsep}{os.environ['PATH']}", "OMP_NUM_THREADS": "1"}
    return subprocess.run(cmd, cwd=cwd, capture_output=True, text=True, env=env, **kwargs)


def profiled(tmp_path, monkeypatch) -> dict:
    """The names the Profiler example leaves behind, after running it in ``tmp_path`` on a small model."""
    from torch import nn

    class Block(nn.Module):
        def __init__(self):
            super().__init__()
            self.fc1, self.fc2 = nn.Linear(8, 16), nn.Linear(16, 8)

        def forward(self, x):
            return self.fc2(torch.relu(self.fc1(x)))

    torch.manual_seed(0)
    model = nn.Sequential()
    model.encoder = nn.Sequential(Block(), Block())
    model.head = nn.Linear(8, 3)
    x, y = torch.randn(120, 8), torch.randint(0, 3, (120,))
    names = {"model": model, "loader": [(x[i:i + 4], y[i:i + 4]) for i in range(0, 120, 4)], "epochs": 2,
             "criterion": nn.CrossEntropyLoss(), "optimizer": torch.optim.SGD(model.parameters(), lr=0.1)}
    monkeypatch.chdir(tmp_path)
    exec(example("python", "Profiler("), names)
    return names


def test_profiler_example_records_the_matching_layers(tmp_path, monkeypatch):
    names = profiled(tmp_path, monkeypatch)
    samples = names["samples"]
    # every=20 over 2 epochs of 30 steps, numbered across them (numbered per epoch, step 0 came twice)
    assert [(int(s["step"]), int(s["epoch"])) for s in samples] == [(0, 1), (20, 1), (40, 2)]
    assert names["attrs"]["op"] == "linear"
    assert samples[0]["A"].shape == (4, 8) and samples[0]["dO"].shape == (4, 16)
    with h5py.File(tmp_path / "context.h5") as f:
        assert list(f.attrs["layers"]) == ["encoder.0.fc1", "encoder.1.fc1"]


def test_library_example_gives_the_profiled_context_its_verdicts(tmp_path, monkeypatch, capsys):
    profiled(tmp_path, monkeypatch)
    capsys.readouterr()
    threads = torch.get_num_threads()
    torch.set_num_threads(1)  # the cores are shared with the other test workers
    try:
        exec(example("python", "detect.judge("), {})
    finally:
        torch.set_num_threads(threads)
    assert capsys.readouterr().out.splitlines() == ["blocked_gemm pass none", "blocked_gemm+lane:4 fail periodic_lane"]


def test_alter_example_replays_byte_identically(tmp_path):
    from torch import nn

    from peat import checkpoint

    torch.manual_seed(0)
    model = nn.Sequential(nn.Conv2d(3, 8, 3), nn.Flatten(), nn.Linear(8 * 6 * 6, 10))
    checkpoint.save(tmp_path / "ckpt.h5", model, None, step=1, epoch=1, meta={}, history=[])
    proc = run(["bash", "-e", "-c", example("bash", "peat alter ckpt.h5")], tmp_path)
    assert proc.returncode == 0, proc.stderr

    assert (tmp_path / "bad.h5").read_bytes() == (tmp_path / "again.h5").read_bytes()
    flips = json.loads((tmp_path / "flips.json").read_text())
    diff = json.loads((tmp_path / "diff.json").read_text())
    assert sum(r["differing"] for r in diff["datasets"]) == 10
    assert len(flips["injections"]) == 10
    with h5py.File(tmp_path / "ckpt.h5") as a, h5py.File(tmp_path / "bad.h5") as b:
        for name in ("model/0.weight", "model/2.weight"):
            xor = a[name][()].view(np.uint32) ^ b[name][()].view(np.uint32)
            assert set(np.unique(xor)) <= {0, 1 << 30}  # bit 1 (sign = bit 0): the exponent's MSB


DDP_NAMES = """
import torch
from torch import nn
torch.manual_seed(0)
model = nn.Sequential(nn.Linear(6, 12), nn.ReLU(), nn.Linear(12, 3))
x, y = torch.randn(240, 6), torch.randint(0, 3, (240,))
loss_fn = nn.CrossEntropyLoss()
global_batches = [torch.arange(i, i + 24) for i in range(0, 240, 24)]
"""


def test_sdc_example_runs_under_torchrun_without_alarms(tmp_path):
    code = example("python", "sdc.Guard(")
    # The optimizer is the reader's: made right after DDP wraps the model, as in any DDP loop.
    code = code.replace("ddp = DDP(model)\n", "ddp = DDP(model)\noptimizer = torch.optim.SGD(ddp.parameters(), lr=0.1)\n")
    script = tmp_path / "train.py"
    script.write_text(DDP_NAMES + code + textwrap.dedent("""
        import hashlib
        digest = hashlib.sha256(b"".join(p.detach().numpy().tobytes() for p in model.parameters())).hexdigest()
        print(f"rank {rank} weights {digest}")
        dist.destroy_process_group()
        """))
    proc = run([str(BIN / "torchrun"), "--standalone", "--nproc-per-node", "3", str(script)], tmp_path, timeout=300)
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]

    # A digest is 64 hex digits: the ranks share one pipe, and one rank's newline may come after another's line.
    digests = set(re.findall(r"rank \d weights ([0-9a-f]{64})", proc.stdout))
    assert len(re.findall(r"rank \d weights", proc.stdout)) == 3 and len(digests) == 1  # replicas agree
    names = {}
    exec(DDP_NAMES, names)
    initial = hashlib.sha256(b"".join(p.detach().numpy().tobytes() for p in names["model"].parameters())).hexdigest()
    assert digests != {initial}  # and they trained
    events = tmp_path / "sdc_events.jsonl"
    assert not events.exists() or events.read_text() == ""  # a clean run raises no alarm
    assert not (tmp_path / "sdc_stop.pt").exists()


def test_own_kernel_recipe_of_the_quick_start_plans_its_verdict(tmp_path):
    """The Quick start's config line and command, as printed, plan a new kernel file's playback
    and verdict."""
    recipe = README[README.index("**Your own kernel, to a verdict.**"):]
    recipe = recipe[:recipe.index("\n\n")]
    line = re.search(r"`(\w+): (\{op: .*?\})` in `config/test.yaml`", recipe)
    command = re.search(r"`snakemake --cores all (results/detect/\S+\.json) --configfile config/test\.yaml`", recipe)
    assert line and command, recipe
    name, entry = line.group(1), yaml.safe_load(line.group(2))
    kernel = tmp_path / entry["impl"]
    kernel.parent.mkdir(parents=True)
    kernel.write_text(f"OP = {entry['op']!r}\n\n\ndef forward(x, weight, bias, **kw):\n    return x\n")
    config = yaml.safe_load(TEST_CONFIG.read_text())
    config["kernels"][name] = entry
    (tmp_path / "test.yaml").write_text(yaml.safe_dump(config))

    proc = snakemake(tmp_path, "-n", command.group(1), configfile=tmp_path / "test.yaml")
    model = command.group(1).split("/")[2]
    assert f"results/playback/{model}/cpu/{name}.parquet" in proc.stdout
    assert f"wildcards: model={model}, vendor=cpu, kernel={name}" in proc.stdout


def test_layout_names_every_top_level_item_and_only_existing_ones():
    """The Layout section's table names each top-level item git holds, and nothing that is not there."""
    layout = README[README.index("## Layout\n"):]
    named = {m.rstrip("/") for row in re.findall(r"^\| (.*?) \|", layout, re.M) for m in re.findall(r"`([^`]+)`", row)}
    tracked = subprocess.run(["git", "ls-files"], cwd=REPO, capture_output=True, text=True, check=True).stdout
    top = {line.split("/")[0] for line in tracked.splitlines()} - {"README.md", ".gitignore"}
    assert top - {n.split("/")[0] for n in named} == set(), "top-level items the Layout section leaves out"
    assert {n for n in named if not (REPO / n).exists()} == set(), "named in Layout but absent"


def test_sdc_config_example_holds_the_schema_defaults():
    """The drill stage's `sdc:` block is a valid config section with the schema's defaults (bar the
    models it drills), so a reader copying it gets what leaving it out gives."""
    from peat.config import validate

    sdc = yaml.safe_load(example("yaml", "bench_steps:"))["sdc"]
    config, schema = yaml.safe_load(TEST_CONFIG.read_text()), REPO / "workflow/schemas/config.schema.yaml"
    defaults = validate({**config, "sdc": {"models": sdc["models"]}}, schema)["sdc"]
    assert validate({**config, "sdc": sdc}, schema)["sdc"] == defaults


FENCE = re.compile(r"^```.*?^```", re.S | re.M)
LINK = re.compile(r"\[[^\]]*\]\(([^)\s]+)\)")


def slugs(markdown: str) -> Iterator[str]:
    """The #anchors GitHub gives a file's headings: lowercased, punctuation but - and _ dropped,
    spaces to -, a repeated slug numbered -1, -2, ..."""
    seen: dict[str, int] = {}
    for heading in re.findall(r"^#{1,6} +(.+?) *#*$", FENCE.sub("", markdown), re.M):
        slug = re.sub(r"[^\w\- ]", "", heading.lower()).replace(" ", "-")
        seen[slug] = seen.get(slug, -1) + 1
        yield slug if seen[slug] == 0 else f"{slug}-{seen[slug]}"


def broken_links(path) -> list[str]:
    """Each relative link of the Markdown file ``path`` (outside code) whose file or #anchor is missing."""
    text = FENCE.sub("", path.read_text())
    text = re.sub(r"`[^`\n]*`", "", text)  # a code span is no link: `x[i](j)`
    broken = []
    for target in LINK.findall(text):
        if re.match(r"[a-z]+:", target):  # https:, mailto:
            continue
        file, _, anchor = target.partition("#")
        dest = (path.parent / file).resolve() if file else path
        if not dest.exists():
            broken.append(f"{target}: no such file")
        elif anchor and (dest.suffix != ".md" or anchor not in set(slugs(dest.read_text()))):
            broken.append(f"{target}: no heading #{anchor} in {dest.relative_to(REPO)}")
    return broken


def test_every_relative_link_leads_to_a_file_and_heading():
    """The README and docs link one another by file and #anchor: a moved section or renamed heading
    broke them without a word."""
    broken = {str(path.relative_to(REPO)): links for path in DOCS if (links := broken_links(path))}
    assert broken == {}


def test_slugs_follow_githubs_rules():
    """Punctuation and code marks dropped, a heading inside a code block none, a repeated one numbered."""
    assert list(slugs("# Kernels: bring your own, and the shipped alternatives\n## Checkpoint alteration "
                      "(`peat alter`, `peat h5diff`)\n```sh\n# a comment\n```\n## Layout\n## Layout\n")) == [
        "kernels-bring-your-own-and-the-shipped-alternatives", "checkpoint-alteration-peat-alter-peat-h5diff",
        "layout", "layout-1"]

"""Runs every ```python block of the user guide, so the docs cannot rot.

Each block is self-contained and runs on its own:

- a plain block runs in this process, in a fresh namespace, inside a temporary working
  directory (files a block writes land there);
- a block preceded by ``<!-- ranks: N -->`` runs on N ranks of the tessera.testing harness
  (fixture ``dist``) in workers that have NO default process group but hold torchrun's
  environment (RANK, WORLD_SIZE, LOCAL_RANK, MASTER_ADDR, MASTER_PORT): the block calls
  ``launch_from_torch`` exactly as a script started by ``torchrun`` would;
- ``<!-- ranks: N, launcher: slurm -->`` / ``launcher: openmpi`` additionally sets the variables
  ``srun`` / ``mpirun`` would set (SLURM_PROCID, ... / OMPI_COMM_WORLD_RANK, ...).

After a block, the runner destroys whatever context or process group it left behind, so the
workers can be reused. ```bash and ```text blocks are not run.

Also checked: every relative link and image of the guide points at an existing file.
"""

from __future__ import annotations

import os
import pathlib
import re
import tempfile
from dataclasses import dataclass

import pytest

DOCS = pathlib.Path(__file__).resolve().parent
FENCE = re.compile(r"^```(\w*)\s*$")
MARKER = re.compile(r"^<!--\s*ranks:\s*(\d+)\s*(?:,\s*launcher:\s*(\w+)\s*)?-->\s*$")
LINK = re.compile(r"\]\(([^)#\s]+)(?:#[^)]*)?\)")
#: Seconds one multi-rank block may take (several ranks share two cores in CI).
BLOCK_TIMEOUT = 180.0

LAUNCHER_ENV = {
    "slurm": {"SLURM_PROCID": "RANK", "SLURM_NPROCS": "WORLD_SIZE", "SLURM_LOCALID": "LOCAL_RANK"},
    "openmpi": {
        "OMPI_COMM_WORLD_RANK": "RANK",
        "OMPI_COMM_WORLD_SIZE": "WORLD_SIZE",
        "OMPI_COMM_WORLD_LOCAL_RANK": "LOCAL_RANK",
    },
}


@dataclass(frozen=True)
class Block:
    """One ```python block of a page."""

    page: str
    line: int  # 1-based line of the opening fence
    code: str
    ranks: int  # 0: run in this process
    launcher: str = "torchrun"

    @property
    def name(self) -> str:
        """``page:line``, the test id."""
        return f"{self.page}:{self.line}"


def extract_blocks(text: str, page: str) -> list[Block]:
    """Every ```python block of ``text``, with the ``ranks`` marker that precedes it."""
    blocks: list[Block] = []
    lines = text.splitlines()
    i = 0
    while i < len(lines):
        fence = FENCE.match(lines[i])
        if not fence:
            i += 1
            continue
        lang, start = fence.group(1), i
        end = start + 1
        while end < len(lines) and lines[end].strip() != "```":
            end += 1
        if end == len(lines):
            raise AssertionError(f"{page}:{start + 1}: unterminated code block")
        if lang == "python":
            ranks, launcher = 0, "torchrun"
            before = start - 1
            while before >= 0 and not lines[before].strip():
                before -= 1
            marker = MARKER.match(lines[before].strip()) if before >= 0 else None
            if marker:
                ranks = int(marker.group(1))
                launcher = marker.group(2) or "torchrun"
                assert launcher in ("torchrun", *LAUNCHER_ENV), f"{page}: launcher {launcher}"
            # leading blank lines: tracebacks show the page's own line numbers
            code = "\n" * (start + 1) + "\n".join(lines[start + 1 : end]) + "\n"
            blocks.append(Block(page, start + 1, code, ranks, launcher))
        i = end + 1
    return blocks


def pages() -> list[pathlib.Path]:
    """The guide's pages."""
    return sorted(DOCS.glob("*.md"))


def all_blocks() -> list[Block]:
    """Every ```python block of every page."""
    return [b for p in pages() for b in extract_blocks(p.read_text(), p.name)]


def _clean_up() -> None:
    """Destroy what a block left: the current context and the default group."""
    import torch.distributed as tdist

    from tessera.context import get_context, has_context

    if has_context():
        get_context().destroy()
    if tdist.is_available() and tdist.is_initialized():
        tdist.destroy_process_group()


def _exec(code: str, name: str) -> None:
    page = name.split(":")[0]
    namespace = {"__name__": "__docs__", "__file__": page}
    exec(compile(code, str(DOCS / page), "exec"), namespace)


def run_block_on_rank(code: str, name: str, workdir: str, launcher: str) -> int:
    """Body run by every rank: torchrun's (and the launcher's) environment, then the block."""
    for var, source in LAUNCHER_ENV.get(launcher, {}).items():
        os.environ[var] = os.environ[source]
    os.environ.setdefault("LOCAL_RANK", os.environ["RANK"])
    previous = os.getcwd()
    os.chdir(workdir)
    try:
        _exec(code, name)
    finally:
        os.chdir(previous)
        _clean_up()
        for var in LAUNCHER_ENV.get(launcher, {}):
            os.environ.pop(var, None)
    return int(os.environ["RANK"])


BLOCKS = all_blocks()


def test_the_guide_has_code() -> None:
    """The guide exists and holds code, some of it multi-rank."""
    assert len(pages()) >= 10
    assert len(BLOCKS) >= 20
    assert any(b.ranks > 1 for b in BLOCKS)


def test_extract_blocks_reads_markers() -> None:
    """Blocks, their lines and their rank markers are found; other languages are not run."""
    text = "x\n<!-- ranks: 4 -->\n\n```python\na = 1\n```\n```bash\nls\n```\n```python\nb\n```\n"
    found = extract_blocks(text, "t.md")
    assert [(b.line, b.ranks, b.code.strip()) for b in found] == [(4, 4, "a = 1"), (10, 0, "b")]
    slurm = extract_blocks("<!-- ranks: 2, launcher: slurm -->\n```python\npass\n```\n", "s.md")
    assert (slurm[0].ranks, slurm[0].launcher) == (2, "slurm")


@pytest.mark.parametrize("page", [p.name for p in pages()])
def test_links_resolve(page: str) -> None:
    """Relative links and images point at existing files."""
    text = (DOCS / page).read_text()
    missing = [
        target
        for target in LINK.findall(text)
        if "://" not in target and not (DOCS / target).exists()
    ]
    assert missing == [], f"{page} links to missing files: {missing}"


@pytest.mark.parametrize("block", [b for b in BLOCKS if b.ranks == 0], ids=lambda b: b.name)
def test_single_process_block(block: Block, tmp_path: pathlib.Path, monkeypatch) -> None:
    """A plain block runs in this process."""
    monkeypatch.chdir(tmp_path)
    try:
        _exec(block.code, block.name)
    finally:
        _clean_up()


@pytest.mark.parametrize("block", [b for b in BLOCKS if b.ranks > 0], ids=lambda b: b.name)
def test_multi_rank_block(block: Block, dist) -> None:
    """A ``<!-- ranks: N -->`` block runs on N ranks, each launching like under torchrun."""
    with tempfile.TemporaryDirectory() as workdir:
        ranks = dist.run(
            run_block_on_rank,
            world_size=block.ranks,
            args=(block.code, block.name, workdir, block.launcher),
            init_process_group=False,
            timeout=BLOCK_TIMEOUT,
        )
    assert ranks == list(range(block.ranks))

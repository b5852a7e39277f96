"""The commands and Python snippets in README.md and docs/*.md run as written (issue 25).

Every ```python block, every command in a ```bash block, and every ``$ ``-prompted command in a
```console (or plain) block is extracted and run, in document order, in one scratch folder per
document, with ``automap`` on PATH. A block may be preceded by one marker comment:

    <!-- doc-test: slow; folder llama path/to/llama; skip needs a GPU -->

- ``skip REASON``: not run, and the reason is required (a GPU, several processes, an install);
- ``slow``: run only with ``-m slow`` (planning a 70B shape takes a while on a laptop CPU);
- ``folder FAMILY PATH`` / ``config FAMILY PATH``: before the block, a small random-weight
  Hugging Face folder (or just its config.json) of that family is written at PATH. README.md and
  docs/ use none (checked below): a reader cannot see them, so the folders their snippets load come
  from a block the reader runs too, ``automap demo --save models``. Nothing is downloaded.

A block runs when it exits 0 without a traceback; what it prints is the docs' business.
"""

from __future__ import annotations

import os
import re
import shlex
import subprocess
import sys
from dataclasses import dataclass, field
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]
DOCS = [ROOT / "README.md", *sorted((ROOT / "docs").glob("*.md"))]
MARKER = re.compile(r"<!--\s*doc-test:\s*(.*?)\s*-->")
FENCE = re.compile(r"^```(\w*)\s*$")
# Small shapes of the families the docs name (random weights, saved with save_pretrained).
FAMILIES = {
    "llama": dict(
        model_type="llama",
        hidden_size=64,
        intermediate_size=128,
        num_hidden_layers=2,
        num_attention_heads=4,
        num_key_value_heads=2,
        vocab_size=256,
        max_position_embeddings=256,
    ),
    "gptj": dict(
        model_type="gptj", n_embd=64, n_layer=2, n_head=4, rotary_dim=8, vocab_size=256, n_positions=256
    ),
}


@dataclass
class Block:
    doc: Path
    line: int
    kind: str  # "python" or "shell"
    code: str
    skip: str = ""
    slow: bool = False
    setup: list[tuple[str, str, str]] = field(default_factory=list)  # (folder|config, family, path)

    @property
    def id(self) -> str:
        return f"{self.doc.name}:{self.line}"


def _commands(lines: list[str], prompted: bool) -> list[str]:
    """Shell commands in a block: every non-comment line (``bash``) or the ``$ `` lines
    (console), with backslash continuations joined."""
    commands: list[str] = []
    pending = ""
    for line in lines:
        if not pending:
            if prompted and not line.startswith("$ "):
                continue
            line = line[2:] if prompted else line
            if not line.strip() or line.lstrip().startswith("#"):
                continue
        pending += line.rstrip()
        if pending.endswith("\\"):
            pending = pending[:-1] + " "
            continue
        commands.append(pending.strip())
        pending = ""
    return commands


def _options(text: str, block: Block) -> None:
    for item in filter(None, (i.strip() for i in text.split(";"))):
        word, _, rest = item.partition(" ")
        if word == "skip":
            block.skip = rest.strip() or "(no reason)"
        elif word == "slow":
            block.slow = True
        elif word in ("folder", "config"):
            family, path = rest.split()
            block.setup.append((word, family, path))
        else:
            raise ValueError(f"{block.id}: unknown doc-test marker {item!r}")


def extract(doc: Path) -> list[Block]:
    """The runnable blocks of ``doc``, with their markers."""
    blocks, lines = [], doc.read_text().splitlines()
    marker, i = "", 0
    while i < len(lines):
        found = MARKER.search(lines[i])
        if found:
            marker = found.group(1)
        fence = FENCE.match(lines[i])
        if not fence:
            i += 1
            continue
        end = next(j for j in range(i + 1, len(lines)) if lines[j].startswith("```"))
        body, lang = lines[i + 1 : end], fence.group(1)
        code = (
            "\n".join(body)
            if lang == "python"
            else "\n".join(_commands(body, prompted=lang != "bash"))
            if lang in ("bash", "console", "")
            else ""
        )
        if code.strip():
            block = Block(doc, i + 1, "python" if lang == "python" else "shell", code)
            _options(marker, block)
            blocks.append(block)
        marker, i = "", end + 1
    return blocks


ALL = [b for doc in DOCS for b in extract(doc)]


def _params() -> list:
    params = []
    for b in ALL:
        marks = [pytest.mark.skip(reason=b.skip)] if b.skip else [pytest.mark.slow] if b.slow else []
        params.append(pytest.param(b, id=b.id, marks=marks))
    return params


@pytest.fixture(scope="module")
def scratch(tmp_path_factory):
    """One folder per document (blocks of a document share files, as a reader's shell does),
    and a bin/ with an ``automap`` that runs this checkout."""
    base = tmp_path_factory.mktemp("docs")
    shim = base / "bin" / "automap"
    shim.parent.mkdir()
    shim.write_text(f'#!/bin/sh\nexec {shlex.quote(sys.executable)} -m automap "$@"\n')
    shim.chmod(0o755)
    return base


def _write_setup(kind: str, family: str, path: Path) -> None:
    code = f"import transformers; config = transformers.AutoConfig.for_model(**{FAMILIES[family]!r}); " + (
        f"config.save_pretrained({str(path)!r})"
        if kind == "config"
        else f"transformers.AutoModelForCausalLM.from_config(config).save_pretrained({str(path)!r})"
    )
    if kind == "config" and path.suffix == ".json":
        code = code.replace(f"save_pretrained({str(path)!r})", f"save_pretrained({str(path.parent)!r})")
    subprocess.run([sys.executable, "-c", code], check=True, timeout=300)


@pytest.mark.parametrize("block", _params())
def test_doc_block_runs(block: Block, scratch: Path):
    cwd = scratch / block.doc.stem
    cwd.mkdir(exist_ok=True)
    for kind, family, path in block.setup:
        if not (cwd / path).exists():
            _write_setup(kind, family, cwd / path)
    env = {
        **os.environ,
        "PATH": f"{scratch / 'bin'}{os.pathsep}{os.environ['PATH']}",
        "PYTHONPATH": os.pathsep.join(filter(None, [str(ROOT), os.environ.get("PYTHONPATH", "")])),
    }
    argv = [sys.executable, "-c", block.code] if block.kind == "python" else ["bash", "-ec", block.code]
    done = subprocess.run(argv, cwd=cwd, env=env, capture_output=True, text=True, timeout=1200)
    out = done.stdout + done.stderr
    assert done.returncode == 0 and "Traceback" not in out, (
        f"{block.id} failed:\n{block.code}\n---\n{out[-3000:]}"
    )


def test_every_block_is_marked_or_runs_and_skips_say_why():
    assert len(ALL) > 10
    assert all(b.skip != "(no reason)" for b in ALL)
    uncommented = {b.id: re.sub(r"#.*", "", b.code) for b in ALL if not b.skip}  # a comment may say "..."
    literal = [name for name, code in uncommented.items() if re.search(r"(?<![\w.])\.\.\.(?![\w.])", code)]
    assert not literal, f"literal '...' in runnable blocks: {literal}"


def test_every_folder_a_block_names_is_made_by_a_block_a_reader_runs():
    """A fresh clone, nothing downloaded: the folders the snippets load come from an earlier
    snippet (``automap demo --save models``), not from a setup marker the reader never sees."""
    hidden = [b.id for b in ALL if b.setup]
    assert not hidden, f"blocks that need a folder made behind the reader's back: {hidden}"
    for doc in DOCS:
        blocks = extract(doc)
        users = [b for b in blocks if "models/" in b.code and not b.skip]
        makers = [i for i, b in enumerate(blocks) if "automap demo --save models" in b.code and not b.skip]
        for b in users:
            assert makers and blocks.index(b) >= makers[0], f"{b.id} uses models/ before a block makes it"


def test_links_resolve_inside_the_project():
    broken = []
    for doc in DOCS:
        prose = re.sub(r"```.*?```|`[^`\n]*`", "", doc.read_text(), flags=re.S)  # code is not a link
        for target in re.findall(r"\]\(([^)#\s]+)(?:#[^)]*)?\)", prose):
            if "://" in target or target.startswith("mailto:"):
                continue
            path = (doc.parent / target).resolve()
            if not path.exists() or ROOT not in path.parents:
                broken.append(f"{doc.name}: {target}")
    assert not broken, broken


def test_the_readme_reads_in_two_minutes_and_the_index_lists_every_page():
    lines = (ROOT / "README.md").read_text().splitlines()
    assert len(lines) <= 150, f"README.md has {len(lines)} lines; move detail to docs/"
    first = next((i for i, line in enumerate(lines, 1) if "](docs/" in line), None)
    assert first is not None and first <= 120, f"the first link to docs/ is on line {first}"
    index = (ROOT / "docs" / "index.md").read_text()
    pages = [p.name for p in sorted((ROOT / "docs").glob("*.md")) if p.name != "index.md"]
    missing = [name for name in pages if f"]({name}" not in index]
    assert not missing, f"docs/index.md does not list {missing}"

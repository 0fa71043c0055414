"""The repository speaks of the project, not of how it was made, and its documents' links resolve.

Every file of the checkout (what git tracks, and new files it does not ignore) is searched for
references to the development process: "session 12", "sessions 22-25", "this session", "the
session's ...". Where a date, a commit or a version says when something held, write that. The
word in pytest's sense (a test session, `scope="session"`, `pytest_sessionfinish`) and the OS's
(processes in sessions of their own) is not such a reference.

Every relative link in README.md, docs/*.md and benchmarks/*.md must name a file or folder that
exists, and its `#anchor` a heading of that file (GitHub's slugs).
"""

import re
import shlex
import subprocess
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parents[1]
THIS = Path(__file__).resolve().relative_to(REPO).as_posix()

PROCESS = re.compile(
    r"\bsessions? \d+"  # session 12, sessions 22-25
    r"|\b(?:this|that|the|an earlier|a later|earlier|later|previous|next) sessions?\b"
    r"|(?<!test )\bsession's\b",  # a test session's fixtures are pytest's
    re.IGNORECASE,
)
FENCE = re.compile(r"^\s*(```|~~~)")
LINK = re.compile(r"!?\[[^\]]*\]\(\s*<?([^)\s>]+)>?(?:\s+\"[^\"]*\")?\s*\)")
HEADING = re.compile(r"^(#{1,6})\s+(.*?)\s*#*\s*$")


def checkout_files() -> list[str]:
    try:
        out = subprocess.run(
            ["git", "ls-files", "-z", "--cached", "--others", "--exclude-standard"],
            cwd=REPO,
            capture_output=True,
            check=True,
        ).stdout
    except (OSError, subprocess.CalledProcessError):
        pytest.skip("not a git checkout")
    return sorted({p for p in out.decode().split("\0") if p and (REPO / p).is_file()})


def process_references(path: str) -> list[str]:
    data = (REPO / path).read_bytes()
    if b"\0" in data:  # binary
        return []
    text = data.decode("utf-8", errors="replace")
    return [
        f"{path}:{n}: {line.strip()[:120]}"
        for n, line in enumerate(text.splitlines(), 1)
        if PROCESS.search(line)
    ]


def test_no_file_speaks_of_how_it_was_made():
    found = [hit for p in checkout_files() if p != THIS for hit in process_references(p)]
    assert not found, (
        "these lines speak of the development process; say what the project is (a date, a "
        "commit, a version) or drop it:\n" + "\n".join(found)
    )


def prose_lines(text: str) -> list[str]:
    """The lines of a markdown text outside fenced code blocks."""
    lines, fenced = [], False
    for line in text.splitlines():
        if FENCE.match(line):
            fenced = not fenced
        elif not fenced:
            lines.append(line)
    return lines


def slugs(md: Path) -> set[str]:
    """The anchors GitHub gives the headings of a markdown file."""
    seen: dict[str, int] = {}
    for line in prose_lines(md.read_text()):
        m = HEADING.match(line)
        if not m:
            continue
        title = re.sub(r"\[([^\]]*)\]\([^)]*\)", r"\1", m.group(2))  # a link's text only
        slug = re.sub(r"[^\w\- ]", "", title.strip().lower()).replace(" ", "-")
        n = seen.get(slug, 0)
        seen[slug] = n + 1
        if n:
            seen[f"{slug}-{n}"] = 1
    return set(seen)


def broken_links(md: Path) -> list[str]:
    where = md.relative_to(REPO).as_posix()
    broken = []
    for line in prose_lines(md.read_text()):
        line = re.sub(r"`[^`]*`", "code", line)  # inline code is not a link
        for target in LINK.findall(line):
            if re.match(r"^[a-zA-Z][a-zA-Z0-9+.-]*:|^//", target):
                continue  # http:, https:, mailto: ...
            path, _, anchor = target.partition("#")
            dest = (md.parent / path).resolve() if path else md
            if not dest.exists():
                broken.append(f"{where}: {target} (no such file)")
            elif anchor and dest.suffix == ".md" and anchor not in slugs(dest):
                broken.append(f"{where}: {target} (no heading #{anchor})")
    return broken


def test_every_relative_link_in_the_docs_resolves():
    docs = [REPO / "README.md", *sorted((REPO / "docs").glob("*.md"))]
    docs += sorted((REPO / "benchmarks").glob("*.md"))
    broken = [b for md in docs for b in broken_links(md)]
    assert not broken, "links to nothing:\n" + "\n".join(broken)


def test_the_link_check_sees_anchors_and_missing_files(tmp_path, monkeypatch):
    monkeypatch.setattr(f"{__name__}.REPO", tmp_path)
    (tmp_path / "a.md").write_text(
        "# Host memory of `offload` (ZeRO-2)\n\n## Reports\n## Reports\n"
    )
    md = tmp_path / "b.md"
    md.write_text(
        "[ok](a.md#host-memory-of-offload-zero-2) [ok](a.md#reports-1) [web](https://x.org/a)\n"
        "[gone](c.md) [no heading](a.md#nothing) `[code](c.md)`\n"
        "```\n[fenced](c.md)\n```\n"
    )
    assert broken_links(md) == [
        "b.md: c.md (no such file)",
        "b.md: a.md#nothing (no heading #nothing)",
    ]
    assert PROCESS.search("measured in session 20") and PROCESS.search("the session's fix")
    assert not PROCESS.search('@pytest.fixture(scope="session")')
    assert not PROCESS.search("the test session's prepared data; sessions of their own")


# ----------------------------------------------------------------------------- commands

PLACEHOLDERS = {"CONFIG": "yaml/tiny.yaml", "DIR": "runs-doc-check", "RUN": "runs/tiny"}
CHEAP = ("config", "estimate")  # pure arithmetic on a config: every such line is run


def fenced_lines(text: str) -> list[tuple[int, str]]:
    """(line number, line) inside fenced code blocks, continuation lines (`\\`) joined."""
    out, fenced, pending = [], False, None
    for n, line in enumerate(text.splitlines(), 1):
        if FENCE.match(line):
            fenced = not fenced
            continue
        if not fenced:
            continue
        if pending is not None:
            pending = (pending[0], pending[1] + " " + line.strip())
        else:
            pending = (n, line.strip())
        if pending[1].endswith("\\"):
            pending = (pending[0], pending[1][:-1].rstrip())
            continue
        out.append(pending)
        pending = None
    return out


def doc_commands() -> list[tuple[str, list[str]]]:
    """("file:line", argv after `scale-llm`) for every `scale-llm ...` command of a fenced
    block in README.md and docs/ (`a && b`: both): comments and pipes dropped, `[a|b]` read as
    a and `[--flag]` as --flag, CONFIG, DIR and RUN given values; commands with other
    upper-case placeholders (PATH, N) or `...` left out."""
    found = []
    for md in [REPO / "README.md", *sorted((REPO / "docs").glob("*.md"))]:
        where = md.relative_to(REPO).as_posix()
        for n, line in fenced_lines(md.read_text()):
            line = line.removeprefix("$ ")
            if not line.startswith("scale-llm "):
                continue
            line = re.sub(r"\[([\w.-]+)(\|[\w.-]+)+\]", r"\1", line)  # [bare|gpt2]: bare
            line = re.sub(r"\[([^\]]*)\]", r"\1", line)  # [--force]: the optional part too
            for part in line.split(" | ")[0].split(" && "):
                words = shlex.split(part, comments=True)
                if words[:1] != ["scale-llm"] or any("..." in w for w in words):
                    continue
                words = [PLACEHOLDERS.get(w, w) for w in words[1:]]
                if not any(re.fullmatch(r"(.*=)?[A-Z][A-Z_]+", w) for w in words):
                    found.append((f"{where}:{n}", words))
    return found


def test_every_command_in_the_docs_is_one_the_cli_takes(capsys):
    """Each documented `scale-llm` line parses: its command and every flag exist."""
    from scale_llm.cli import parse_args

    commands = doc_commands()
    assert len(commands) >= 40 and {c[1][0] for c in commands} >= {"train", "estimate", "bench"}
    refused = []
    for where, argv in commands:
        try:
            parse_args(argv)
        except SystemExit:
            refused.append(f"{where}: scale-llm {shlex.join(argv)}\n  {capsys.readouterr().err}")
    assert not refused, "documented commands the CLI refuses:\n" + "\n".join(refused)


def test_the_cheap_commands_in_the_docs_run_as_written(monkeypatch, capsys):
    """`config` and `estimate` lines (arithmetic on a config, no run, no --measure) run from the
    repository root and exit 0."""
    from scale_llm.cli import main

    monkeypatch.chdir(REPO)
    cheap = [
        (where, argv)
        for where, argv in doc_commands()
        if argv[0] in CHEAP and "--measure" not in argv and "--fake" not in argv
    ]
    assert len(cheap) >= 10
    failed = []
    for where, argv in cheap:
        code = main(argv)
        out = capsys.readouterr()
        if code != 0:
            failed.append(f"{where}: scale-llm {shlex.join(argv)} -> {code}\n{out.err[-500:]}")
    assert not failed, "documented commands that fail:\n" + "\n".join(failed)


def test_the_command_reader_joins_lines_and_drops_comments_and_placeholders():
    text = (
        "```bash\n"
        "scale-llm estimate yaml/400m.yaml --world-size 2 \\\n  --set a=1   # note\n"
        "$ scale-llm bench CONFIG --reference [bare|gpt2] | tail -2\n"
        "scale-llm export RUN --out PATH\n"
        "```\nscale-llm not fenced\n"
    )
    lines = fenced_lines(text)
    assert lines[0] == (2, "scale-llm estimate yaml/400m.yaml --world-size 2 --set a=1   # note")
    assert [n for n, _ in lines] == [2, 4, 5]


# ----------------------------------------------------------------------------- the README

# What goes stale in a README: test counts, durations, dated measurements, speeds, and "the same
# values" (of a run on one day). They live in benchmarks/, one dated report per topic.
DRIFTING = re.compile(
    r"\b\d[\d,]*\s+(?:of\s+\d[\d,]*\s+)?tests\b"  # 585 of 699 tests, 705 tests
    r"|\b(?:\d+(?:\.\d+)?|one|two|three|four|five|ten)[\s-]*(?:min|mins|minutes?|hours?)\b"
    r"|\b\d+(?:\.\d+)?\s?(?:s|secs?|seconds?)\b"  # 89.2s, 17 s
    r"|\b\d[\d,.]*\s*(?:tok|tokens)/s\b"  # 6463 tok/s
    r"|\b20\d\d-\d\d-\d\d\b"  # a date
    r"|\bthe same (?:lines and )?values\b",
    re.IGNORECASE,
)


def test_the_readme_carries_no_figure_that_drifts():
    """The README said "about 2 minutes on 2 busy CPU cores (585 of 699 tests, 2026-12-03)",
    "705 tests passed in 17.1 minutes", a run's output at 8084 tok/s and that a later run
    "printed the same lines and values": each was true on one day. The README links to the
    reports in benchmarks/ instead; this test keeps it so."""
    for stale in (
        "about 2 minutes on 2 busy CPU cores (585 of 699 tests, 2026-12-03)",
        "about two minutes on 2 CPU cores",
        "705 tests passed in 17.1 minutes, 19.4 with the setup",
        "done: 150 steps in 89.2s",
        "| 6682 tok/s | elapsed 1m09s",
        "it printed the same lines and values but the speed",
    ):
        assert DRIFTING.search(stale), stale
    readme = (REPO / "README.md").read_text()
    found = [  # (over the whole text: a figure may wrap onto the next line)
        f"README.md:{readme.count(chr(10), 0, m.start()) + 1}: {m.group(0)!r}"
        for m in DRIFTING.finditer(readme)
    ]
    assert not found, "figures that drift belong in benchmarks/ (link them):\n" + "\n".join(found)
    assert "benchmarks/cpu-2core-avx2-test-suite.md" in readme
    assert "benchmarks/cpu-2core-avx512-quickstart.md" in readme
    assert "bash launch/quickstart.sh\n" in readme and "bash launch/test.sh\n" in readme


# ----------------------------------------------------------------------------- guides and reports

# A figure next to a date or a commit id is a measurement taken once: it lives in a report in
# benchmarks/ (with its command, commit, date and hardware), and the guide in docs/ links to it. A
# date or commit that only says when something changed ("checkpoints from before 1c59fbf") may stay.
DATED = re.compile(r"\b20\d\d-\d\d-\d\d\b|\bcommits?\s+`?[0-9a-f]{7,40}\b", re.IGNORECASE)
FIGURE = re.compile(
    r"\b\d[\d,.]*\s?(?:ms|s|min|GiB|MiB|KiB|GB|MB|GB/s|TB/s|TFLOP/s|tok/s|tokens/s|%)(?![\w/])"
    r"|\b\d(?:\.\d+)?e-\d+\b"  # a tolerance met: 9.5e-7
)


def dated_figures(text: str) -> list[str]:
    """The paragraphs, list items and table rows of a markdown text (outside fences) that hold
    both a date or commit id and a measured figure."""
    blocks, block = [], []
    for line in prose_lines(text) + [""]:
        item = re.match(r"\s*(?:[-*]|\d+\.)\s", line)
        if block and (not line.strip() or line.startswith("|") or item):
            blocks.append(" ".join(block))
            block = []
        if line.startswith("|"):
            blocks.append(line)
        elif line.strip():
            block.append(line)
    return [b for b in blocks if DATED.search(b) and FIGURE.search(b)]


def test_the_guides_carry_no_dated_measurement():
    """docs/memory.md had a table with commit, date and hardware columns, docs/backends.md parity
    tables "at commit 45e9c45 ... 2026-12-03": each true on one day. They moved to benchmarks/."""
    assert dated_figures("Measured (commit 83ae3f0,\n2026-12-03): 986.4 ms.\n\nNext.")
    assert dated_figures("| ddp | 9.5e-7 | 07934fb | commit 07934fb |")
    assert not dated_figures("Checkpoints from before 1c59fbf (2026-12-03) are refused.\n")
    assert not dated_figures("A step of 543 ms.\n\nCommit abc1234 changed it.\n")
    assert not dated_figures("- within 1e-5\n- refused before 1c59fbf (2026-12-03)\n")
    found = [
        f"{md.relative_to(REPO).as_posix()}: {b[:120]}"
        for md in sorted((REPO / "docs").glob("*.md"))
        for b in dated_figures(md.read_text())
    ]
    assert not found, "dated measurements belong in benchmarks/ (link the report):\n" + "\n".join(
        found
    )


def test_every_report_names_its_hardware_commit_date_and_command():
    """A figure without its command, commit, date and hardware cannot be checked or redone."""
    reports = sorted((REPO / "benchmarks").glob("*.md"))
    assert reports
    lacking = []
    for md in reports:
        text = md.read_text()
        for what, found in (
            ("**Hardware**", "**Hardware**" in text),
            ("a commit", re.search(r"\bcommits?\s+`?[0-9a-f]{7,40}\b", text, re.IGNORECASE)),
            ("a date", re.search(r"\b20\d\d-\d\d-\d\d\b", text)),
            ("a command", "```bash" in text),
        ):
            if not found:
                lacking.append(f"{md.relative_to(REPO).as_posix()}: no {what}")
    assert not lacking, "\n".join(lacking)


def test_every_report_is_listed_in_the_index():
    """Four reports in benchmarks/ (the avx512 test suite, DeepSpeed saves, sharded start, the
    H100 calibration) were missing from docs/benchmarks.md's table: a user reading the index did
    not learn they exist."""
    index = (REPO / "docs" / "benchmarks.md").read_text()
    listed = set(re.findall(r"\]\(\.\./benchmarks/([^)#]+\.md)\)", index))
    reports = {md.name for md in (REPO / "benchmarks").glob("*.md")}
    assert reports and reports - listed == set(), "list them in docs/benchmarks.md's table"

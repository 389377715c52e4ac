"What a reader meets (issue 57): no generated paragraph or list item over 600 characters, none in the README."
import json, re
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parent.parent
LIMIT = 600

def blocks(text:str):
    "The paragraphs and list items of Markdown, without code, HTML tables, Markdown tables and images."
    t = re.sub(r'```.*?```', '', text, flags=re.S)
    t = re.sub(r'<(table|div|style).*?</\1>', '', t, flags=re.S | re.I)
    for b in re.split(r'\n\s*\n', t):
        for item in re.split(r'\n(?=\s*(?:[-*+]|\d+\.)\s)', b):
            s = ' '.join(l.strip() for l in item.splitlines()
                         if l.strip() and not l.lstrip().startswith(('|', '<', '![')))
            if s: yield s

def test_blocks_splits_paragraphs_and_items():
    md = "one\ntwo\n\n- a\n- " + 'b' * 700 + "\n\n| a table row " + 'x' * 700 + " |\n\n```\n" + 'c' * 900 + "\n```"
    assert [len(b) for b in blocks(md)] == [7, 3, 702]

def _generated(nb:Path):
    for i, c in enumerate(json.loads(nb.read_text(encoding='utf-8'))['cells']):
        for o in c.get('outputs', []):
            md = o.get('data', {}).get('text/markdown', '')
            yield from ((i, b) for b in blocks(''.join(md)))

@pytest.mark.parametrize('nb', sorted((ROOT/'nbs').glob('*.ipynb')), ids=lambda p: p.name)
def test_no_long_generated_paragraph(nb):
    long = [(i, len(b), b[:80]) for i, b in _generated(nb) if len(b) > LIMIT]
    assert not long, f"{nb.name}: generated paragraphs over {LIMIT} characters (cell, length, start): {long}"

def test_readme_is_a_front_door():
    text = (ROOT/'README.md').read_text(encoding='utf-8')
    assert len(text) <= 12_000, f"README.md has {len(text)} characters, more than 12,000"
    long = [(len(b), b[:80]) for b in blocks(text) if len(b) > LIMIT]
    assert not long, f"README.md: paragraphs over {LIMIT} characters: {long}"

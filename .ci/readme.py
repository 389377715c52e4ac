"""Write README.md from nbs/index.ipynb without Quarto.

`nbdev-readme` renders the README with Quarto, which users building the docs have; this script gives
the same content from nbdev's own notebook processing (`nbdev.serve.proc_nbs`) and nbconvert's
Markdown exporter, so that the README can be rebuilt (and checked in CI) on machines without Quarto.
"""
import re, sys, yaml
from pathlib import Path
from nbconvert import MarkdownExporter
from nbdev.serve import proc_nbs
import nbformat

root = Path(__file__).resolve().parent.parent
cache = Path(proc_nbs(str(root/'nbs'), file_glob='index.ipynb', force=True))
nb = nbformat.read(cache/'index.ipynb', as_version=4)
front = {}
if nb.cells and nb.cells[0].cell_type == 'raw' and nb.cells[0].source.startswith('---'):
    front = yaml.safe_load(nb.cells[0].source.strip().strip('-')) or {}
    nb.cells = nb.cells[1:]
nb.cells = [c for c in nb.cells if not (c.cell_type == 'code' and not c.outputs and c.source.strip().startswith('#|'))]
exp = MarkdownExporter(exclude_input=True)
body, _ = exp.from_notebook_node(nb)
body = re.sub(r'<style scoped>.*?</style>\s*', '', body, flags=re.S)   # pandas' inline CSS
body = re.sub(r'\n{3,}', '\n\n', body).strip() + '\n'
head = f"# {front.get('title', 'transject_nb')}\n\n"
if d := front.get('description'): head += f"> {d}\n\n"
out = head + "<!-- Generated from nbs/index.ipynb by `make readme`; edit the notebook, not this file. -->\n\n" + body
(root/'README.md').write_text(out)
print(f"wrote {root/'README.md'} ({len(out)} chars)")

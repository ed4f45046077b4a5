"""A self-contained report.html: markdown-ish tables and base64-embedded PNG figures."""
from __future__ import annotations

import base64
import html
from pathlib import Path

from ..io import atomic_write_text

CSS = """
body{font-family:system-ui,-apple-system,Segoe UI,Roboto,sans-serif;max-width:1100px;margin:2em auto;padding:0 1em;color:#222}
h1{font-size:1.6em}h2{border-bottom:1px solid #ddd;padding-bottom:.2em;margin-top:1.8em}
table{border-collapse:collapse;margin:.8em 0;font-size:.9em}th,td{border:1px solid #ccc;padding:.3em .6em;text-align:right}
th{background:#f3f3f3}td:first-child,th:first-child{text-align:left}
.note{background:#fffbe6;border:1px solid #f0e0a0;padding:.6em 1em;border-radius:4px}
img{max-width:100%;border:1px solid #eee;margin:.5em 0}code{background:#f5f5f5;padding:0 .2em}
"""


def md_table_to_html(md: str) -> str:
    """Convert a pipe table (header, separator, rows) to HTML; other lines become paragraphs."""
    lines = [ln.strip() for ln in md.strip().splitlines() if ln.strip()]
    out, rows = [], []

    def flush():
        if not rows:
            return
        head, *body = rows
        out.append("<table><thead><tr>" + "".join(f"<th>{html.escape(c)}</th>" for c in head) + "</tr></thead><tbody>")
        for r in body:
            out.append("<tr>" + "".join(f"<td>{html.escape(c)}</td>" for c in r) + "</tr>")
        out.append("</tbody></table>")
        rows.clear()

    for ln in lines:
        if ln.startswith("|"):
            cells = [c.strip() for c in ln.strip("|").split("|")]
            if all(set(c) <= set("-: ") for c in cells):
                continue
            rows.append(cells)
        else:
            flush()
            out.append(f"<p>{html.escape(ln)}</p>")
    flush()
    return "\n".join(out)


def img_tag(png: Path, alt: str = "") -> str:
    data = base64.b64encode(Path(png).read_bytes()).decode("ascii")
    return f'<img alt="{html.escape(alt)}" src="data:image/png;base64,{data}"/>'


def page(title: str, sections: list[tuple[str, str]], note: str = "") -> str:
    body = [f"<h1>{html.escape(title)}</h1>"]
    if note:
        body.append(f'<div class="note">{note}</div>')
    for heading, content in sections:
        body.append(f"<h2>{html.escape(heading)}</h2>\n{content}")
    return (f"<!doctype html><html><head><meta charset='utf-8'><title>{html.escape(title)}</title>"
            f"<style>{CSS}</style></head><body>\n" + "\n".join(body) + "\n</body></html>\n")


class StudyReport:
    """report.md and report.html of a study folder built section by section: ``add`` a markdown
    table (and PNG figures, extra HTML), then ``write`` both files atomically with the header note."""

    def __init__(self, out: Path, heading: str) -> None:
        self.out = Path(out)
        self.figures = self.out / "figures"  # where the study's plots go (created here)
        self.figures.mkdir(parents=True, exist_ok=True)
        self.sections: list[tuple[str, str]] = []
        self.md = [f"# {heading}\n"]

    def add_summary(self, title: str, body_md: str) -> None:
        """The study's headline table: written to summary.md (the CLI prints it) and added first."""
        atomic_write_text(self.out / "summary.md", body_md)
        self.add(title, body_md)

    def add(self, title: str, body_md: str, pngs=(), extra_html: str = "") -> None:
        figs = "".join(img_tag(p, Path(p).stem) for p in pngs)
        self.sections.append((title, md_table_to_html(body_md) + figs + extra_html))
        self.md.append(f"## {title}\n\n{body_md}\n" + "".join(f"\n![]({Path(p).relative_to(self.out)})\n" for p in pngs))

    def write(self, title: str, note_html: str) -> Path:
        """Write report.md (the note in markdown under the heading) and report.html; returns the latter."""
        note_md = note_html.replace("<b>", "**").replace("</b>", "**").replace("<code>", "`").replace("</code>", "`")
        atomic_write_text(self.out / "report.md", "\n".join([self.md[0], note_md + "\n", *self.md[1:]]))
        atomic_write_text(self.out / "report.html", page(title, self.sections, note_html))
        return self.out / "report.html"

"""One example rendered through the chat template, each token coloured by whether it is
trained (the response) or masked (the prompt, system text, template markup).

Takes plain (text, trained) pieces so it does not depend on any tokenizer.
"""

from __future__ import annotations

import html
from typing import Iterable

from PySide6.QtWidgets import QLabel, QTextBrowser, QVBoxLayout, QWidget

TRAINED_BG = "#d5f5e3"
TRAINED_FG = "#145a32"
MASKED_BG = "#eceff1"
MASKED_FG = "#78848f"
TRAINED_ALT = "#b9ebcf"
MASKED_ALT = "#dde3e6"


def _piece_html(text: str, trained: bool, alternate: bool) -> str:
    # Show whitespace so a person can see exactly what the model is trained on.
    shown = html.escape(text).replace(" ", "&nbsp;").replace("\t", "&rarr;")
    shown = shown.replace("\n", "&#8629;<br>")
    bg, fg = (TRAINED_BG, TRAINED_FG) if trained else (MASKED_BG, MASKED_FG)
    if alternate:  # every other token a shade darker, so token boundaries are visible
        bg = TRAINED_ALT if trained else MASKED_ALT
    return f'<span style="background:{bg}; color:{fg};">{shown or "&#8709;"}</span>'


class TokenMaskView(QWidget):
    def __init__(self, parent=None):
        super().__init__(parent)
        self.counts = QLabel("No example yet")
        self.counts.setObjectName("caption")
        legend = QLabel(
            f'<span style="background:{TRAINED_BG}; color:{TRAINED_FG};">&nbsp;trained tokens&nbsp;</span>'
            f'&nbsp;&nbsp;<span style="background:{MASKED_BG}; color:{MASKED_FG};">&nbsp;masked (prompt)&nbsp;</span>'
            "&nbsp;&nbsp;<small>alternate shades mark token boundaries</small>"
        )
        self.text = QTextBrowser()
        self.text.setObjectName("tokenText")
        self.text.setOpenLinks(False)
        lay = QVBoxLayout(self)
        lay.setContentsMargins(0, 0, 0, 0)
        lay.addWidget(legend)
        lay.addWidget(self.text, 1)
        lay.addWidget(self.counts)
        self.num_tokens = 0
        self.num_trained = 0

    def set_pieces(self, pieces: Iterable[tuple[str, bool]], note: str = "") -> None:
        parts, total, trained = [], 0, 0
        for i, (text, is_trained) in enumerate(pieces):
            total += 1
            trained += bool(is_trained)
            parts.append(_piece_html(text, bool(is_trained), bool(i % 2)))
        self.num_tokens, self.num_trained = total, trained
        self.text.setHtml(
            '<div style="font-family: monospace; font-size: 10pt; line-height: 150%;">' + "".join(parts) + "</div>"
        )
        masked = total - trained
        summary = f"{total} tokens: {trained} trained, {masked} masked"
        self.counts.setText(summary + (f"  ·  {note}" if note else ""))

    def set_message(self, message: str) -> None:
        self.num_tokens = self.num_trained = 0
        self.text.setHtml(f"<p style='color:#78848f'>{html.escape(message)}</p>")
        self.counts.setText("")

"""``idleless bench make-copy-workload``: a copy-heavy workload built from Python's standard library.

    idleless bench make-copy-workload --output benchmarks/workloads/copy_heavy.json

Requests whose answers copy long runs of their own prompt, the traffic where speculative decoding by
prompt lookup pays (RAG answers, summaries that quote, code edits). Every text comes from the Python
standard library of the interpreter that runs the builder (module docstrings via ``inspect.getdoc``,
short function sources via ``inspect.getsource``) from the fixed lists below, so the workload can be
rebuilt offline on any machine; the Python version is recorded in the file because docstrings change
between versions. Four kinds of request, interleaved evenly:

* ``repeat``: "Repeat the following passage exactly" + a module docstring (its leading paragraphs);
* ``fix_typos``: the same instruction for a passage with deterministic typos (two adjacent letters
  swapped in about one word of 12 of five letters or more), answered by the corrected passage;
* ``quote_document``: a module docstring as a document and a question answered by quoting the one
  paragraph of it that begins with a given phrase;
* ``rename_identifier``: a stdlib function's source in a code block, "rename the parameter ``x`` to
  ``x_value`` and return the whole code" (the parameter used most often in the body).

Each request keeps ``source`` (the text of its prompt the answer should copy) and ``expected`` (the
answer the instruction asks for: the passage, the corrected passage, the paragraph, the renamed code).
Prompts are chat messages rendered with the model's chat template (SmolLM2's adds its default system
prompt), tokenized with Idleless's tokenizer (no BOS); sampling is greedy with the natural end of
sequence, ``max_tokens`` = the expected answer's tokens + max(16, an eighth of them).
"""

from __future__ import annotations

import argparse
import ast
import importlib
import inspect
import json
import random
import re
import sys
import textwrap
from pathlib import Path
from typing import Callable

DEFAULT_OUTPUT = "benchmarks/workloads/copy_heavy.json"
COMMAND = "idleless bench make-copy-workload --output " + DEFAULT_OUTPUT

# Fixed sources (dotted names of stdlib modules, classes or functions).
PASSAGE_SOURCES = ("sched", "tempfile", "ast", "pydoc", "copy", "heapq",
                   "colorsys", "doctest", "tokenize", "timeit", "difflib.SequenceMatcher", "inspect")
DOCUMENT_SOURCES = ("json", "statistics", "csv", "argparse", "uuid", "urllib.parse", "unittest",
                    "plistlib", "pyclbr", "site")
CODE_SOURCES = ("textwrap.dedent", "colorsys.rgb_to_hls", "statistics.mode", "statistics.fmean", "copy.copy",
                "random.Random.choices", "tempfile.mkdtemp", "difflib.get_close_matches", "heapq.nlargest",
                "statistics.correlation")

PASSAGE_BUDGET = 420  # most tokens of a repeat / fix_typos passage
DOCUMENT_BUDGET = 520  # most tokens of a quote_document document
MIN_PROMPT_TOKENS, MAX_PROMPT_TOKENS = 150, 700
TYPO_EVERY = 12  # about one eligible word in this many gets a typo
QUOTE_PHRASE_WORDS = 6
RENAME_SUFFIX = "_value"

REPEAT = "Repeat the following passage exactly, word for word, and write nothing else.\n\n{passage}"
FIX_TYPOS = ("Fix the typos in the following passage. Return the whole corrected passage, with no other "
             "changes, and write nothing else.\n\n{passage}")
QUOTE = ("Read the document below, then answer the question by quoting the document word for word.\n\n"
         "Document:\n{document}\n\nQuestion: what does the document say in the paragraph that begins with "
         "\"{phrase}\"? Quote that whole paragraph exactly.")
RENAME = ("Rename the parameter `{old}` to `{new}` in the following Python code. Return the whole code with "
          "the new name and no other changes.\n\n```python\n{code}\n```")

CountFn = Callable[[str], int]


# --------------------------------------------------------------------------------------------------
# stdlib text
# --------------------------------------------------------------------------------------------------
def resolve(name: str):
    """The stdlib object a dotted name denotes (the longest importable module prefix, then
    attributes). Raises ImportError / AttributeError if it does not exist in this Python."""
    parts = name.split(".")
    for i in range(len(parts), 0, -1):
        try:
            obj = importlib.import_module(".".join(parts[:i]))
        except ImportError:
            continue
        for attr in parts[i:]:
            obj = getattr(obj, attr)
        return obj
    raise ImportError(f"no stdlib module in {name!r}")


def stdlib_doc(name: str) -> str:
    """``inspect.getdoc`` of a stdlib object. Raises ValueError if it has none."""
    doc = inspect.getdoc(resolve(name))
    if not doc:
        raise ValueError(f"{name} has no docstring in Python {sys.version.split()[0]}")
    return doc


def stdlib_source(name: str) -> str:
    """The dedented source of a stdlib function or method (``inspect.getsource``), trailing newline
    stripped. Raises OSError / TypeError where the source is not available (C implementations)."""
    return textwrap.dedent(inspect.getsource(resolve(name))).rstrip("\n")


def paragraphs(text: str) -> list[str]:
    """Blank-line separated paragraphs of ``text`` (empty ones dropped)."""
    return [p.strip("\n") for p in re.split(r"\n[ \t]*\n", text) if p.strip()]


def take_paragraphs(text: str, count: CountFn, budget: int) -> str:
    """The leading paragraphs of ``text`` that fit in ``budget`` tokens (``count(text) -> tokens``),
    joined by blank lines; a first paragraph over the budget is cut to its leading lines."""
    out: list[str] = []
    for p in paragraphs(text):
        if count("\n\n".join(out + [p])) > budget:
            break
        out.append(p)
    if not out:
        lines: list[str] = []
        for line in paragraphs(text)[0].split("\n"):
            if count("\n".join(lines + [line])) > budget:
                break
            lines.append(line)
        out = ["\n".join(lines)]
    return "\n\n".join(out)


# --------------------------------------------------------------------------------------------------
# edits
# --------------------------------------------------------------------------------------------------
def add_typos(text: str, seed: int, every: int = TYPO_EVERY) -> tuple[str, int]:
    """Swap two adjacent, different inner letters in about one of ``every`` words of five letters or
    more (``random.Random(seed)``; at least one word). Returns (text with typos, number of typos)."""
    rng = random.Random(seed)
    words = list(re.finditer(r"[A-Za-z]{5,}", text))
    chosen = [m for m in words if rng.random() < 1.0 / every] or sorted(words, key=lambda m: -len(m.group()))[:1]
    out, last, n = [], 0, 0
    for m in chosen:
        w = m.group()
        spots = [i for i in range(1, len(w) - 2) if w[i] != w[i + 1]]
        if not spots:
            continue
        i = rng.choice(spots)
        out += [text[last:m.start()], w[:i], w[i + 1], w[i], w[i + 2:]]
        last, n = m.end(), n + 1
    out.append(text[last:])
    return "".join(out), n


def _function(code: str) -> ast.FunctionDef:
    node = ast.parse(code).body[0]
    if not isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef)):
        raise ValueError("the code is not a function definition")
    return node


def _occurrences(code: str, name: str) -> list[tuple[int, int]]:
    """(line, byte column) of every use of the variable ``name``: parameters and Name nodes
    (attributes and keyword-argument names of calls are other things and are not counted)."""
    spots = []
    for node in ast.walk(ast.parse(code)):
        if (isinstance(node, ast.Name) and node.id == name) or (isinstance(node, ast.arg) and node.arg == name):
            spots.append((node.lineno, node.col_offset))
    return sorted(set(spots))


def rename_target(code: str) -> str:
    """The parameter of the function in ``code`` used most often (ties: the first in the
    signature), ``self`` and ``cls`` excluded. Raises ValueError if there is none."""
    fn = _function(code)
    a = fn.args
    params = [p.arg for p in a.posonlyargs + a.args + a.kwonlyargs + [x for x in (a.vararg, a.kwarg) if x]]
    params = [p for p in params if p not in ("self", "cls")]
    if not params:
        raise ValueError("the function has no parameter to rename")
    return max(params, key=lambda p: (len(_occurrences(code, p)), -params.index(p)))


def rename_identifier(code: str, old: str, new: str) -> str:
    """``code`` with every use of the variable ``old`` (see ``_occurrences``) renamed to ``new``.
    Raises ValueError if ``new`` is already a name in ``code``."""
    if _occurrences(code, new) or re.search(rf"\b{re.escape(new)}\b", code):
        raise ValueError(f"{new!r} already occurs in the code")
    lines = [line.encode("utf-8") for line in code.split("\n")]
    for row, col in sorted(_occurrences(code, old), reverse=True):
        b = lines[row - 1]
        if b[col:col + len(old)] != old.encode():
            raise ValueError(f"unexpected text at line {row}, column {col}")
        lines[row - 1] = b[:col] + new.encode() + b[col + len(old):]
    return "\n".join(line.decode("utf-8") for line in lines)


def quote_paragraph(document: str) -> str:
    """The paragraph a quote_document request asks for: the longest paragraph after the first
    whose first ``QUOTE_PHRASE_WORDS`` words occur once in ``document``. Raises ValueError if none."""
    paras = paragraphs(document)
    for p in sorted(paras[1:], key=len, reverse=True):
        phrase = quote_phrase(p)
        if len(phrase.split()) == QUOTE_PHRASE_WORDS and document.count(phrase) == 1:
            return p
    raise ValueError("no paragraph with a unique opening phrase")


def quote_phrase(paragraph: str) -> str:
    """The first ``QUOTE_PHRASE_WORDS`` whitespace-separated words of ``paragraph``, single-spaced."""
    return " ".join(paragraph.split()[:QUOTE_PHRASE_WORDS])


# --------------------------------------------------------------------------------------------------
# the workload
# --------------------------------------------------------------------------------------------------
def _interleave(groups: list[list[dict]]) -> list[dict]:
    """Spread the groups evenly: item j of a group of n sits at (j + 0.5) / n; ties by group order."""
    keyed = [((j + 0.5) / len(g), k, item) for k, g in enumerate(groups) for j, item in enumerate(g)]
    return [item for _, _, item in sorted(keyed, key=lambda x: (x[0], x[1]))]


def build_copy_workload(tokenizer) -> dict:
    """Build the copy-heavy workload (the module docstring says what it holds).

    ``tokenizer``: an ``idleless.text.tokenizer.Tokenizer`` with a chat template (SmolLM2's). Returns
    the workload dict in the format of ../shared/workloads/README.md (readable by
    ``idleless.bench.offline.load_workload``), plus per request ``kind``, ``source_name``, ``source``
    and ``expected``. Deterministic for a given Python version and tokenizer. Raises ValueError if a
    prompt falls outside [MIN_PROMPT_TOKENS, MAX_PROMPT_TOKENS] tokens (a docstring that changed)."""
    def count(text: str) -> int:
        return len(tokenizer.encode(text, add_special_tokens=False))

    repeat, typos, quotes, renames = [], [], [], []
    for i, name in enumerate(PASSAGE_SOURCES):
        passage = take_paragraphs(stdlib_doc(name), count, PASSAGE_BUDGET)
        if i % 2 == 0:
            repeat.append(dict(kind="repeat", source_name=name, user=REPEAT.format(passage=passage),
                               source=passage, expected=passage))
        else:
            typo, _ = add_typos(passage, seed=i)
            typos.append(dict(kind="fix_typos", source_name=name, user=FIX_TYPOS.format(passage=typo),
                              source=typo, expected=passage))
    for name in DOCUMENT_SOURCES:
        document = take_paragraphs(stdlib_doc(name), count, DOCUMENT_BUDGET)
        para = quote_paragraph(document)
        quotes.append(dict(kind="quote_document", source_name=name,
                           user=QUOTE.format(document=document, phrase=quote_phrase(para)),
                           source=para, expected=para))
    for name in CODE_SOURCES:
        code = stdlib_source(name)
        old = rename_target(code)
        new = old + RENAME_SUFFIX
        renames.append(dict(kind="rename_identifier", source_name=name,
                            user=RENAME.format(old=old, new=new, code=code), source=code,
                            expected=rename_identifier(code, old, new)))

    requests = []
    for idx, spec in enumerate(_interleave([repeat, quotes, renames, typos])):
        messages = [{"role": "user", "content": spec["user"]}]
        prompt = tokenizer.render_chat(messages)
        ids = tokenizer.encode(prompt, add_special_tokens=False)
        if not MIN_PROMPT_TOKENS <= len(ids) <= MAX_PROMPT_TOKENS:
            raise ValueError(f"{spec['kind']} request from {spec['source_name']}: {len(ids)} prompt tokens, "
                             f"outside [{MIN_PROMPT_TOKENS}, {MAX_PROMPT_TOKENS}]")
        n_expected = count(spec["expected"])
        requests.append({
            "id": f"copy-{idx:02d}-{spec['kind']}", "kind": spec["kind"], "source_name": spec["source_name"],
            "messages": messages, "prompt": prompt, "prompt_token_ids": ids,
            "max_tokens": n_expected + max(16, n_expected // 8),
            "source": spec["source"], "expected": spec["expected"],
        })

    prompt_tokens = sum(len(r["prompt_token_ids"]) for r in requests)
    source_tokens = sum(count(r["source"]) for r in requests)
    kinds = {}
    for r in requests:
        kinds[r["kind"]] = kinds.get(r["kind"], 0) + 1
    return {
        "name": "copy_heavy",
        "description": ("Copy-heavy workload: answers that copy their prompt. repeat a passage, fix the typos of a "
                        "passage, answer a question about a document by quoting one paragraph, rename a parameter "
                        "in a function and return the whole code. Texts are Python standard-library docstrings "
                        "and function sources. Prompts are rendered with the model's chat template "
                        "(add_generation_prompt=True) and tokenized by Idleless's tokenizer (no BOS added)."),
        "model": "SmolLM2-135M-Instruct (the bundled GGUF); tokenizer idleless.text.tokenizer.Tokenizer",
        "builder": {"command": COMMAND, "python": sys.version.split()[0]},
        "sampling": {"temperature": 0.0, "greedy": True, "ignore_eos": False,
                     "max_tokens": "per request: expected answer tokens + max(16, 1/8 of them)"},
        "n_requests": len(requests),
        "stats": {
            "total_prompt_tokens": prompt_tokens,
            "total_max_tokens": sum(r["max_tokens"] for r in requests),
            "source_tokens": source_tokens,
            "source_fraction_of_prompt_tokens": round(source_tokens / prompt_tokens, 3),
            "prompt_tokens_min": min(len(r["prompt_token_ids"]) for r in requests),
            "prompt_tokens_max": max(len(r["prompt_token_ids"]) for r in requests),
            "requests_by_kind": kinds,
        },
        "requests": requests,
    }


def add_args(parser: argparse.ArgumentParser) -> None:
    """Flags of ``idleless bench make-copy-workload``."""
    parser.add_argument("--output", default=DEFAULT_OUTPUT, help="where to write the workload JSON")
    parser.add_argument("--tokenizer", default=None,
                        help="tokenizer directory (default: the bundled SmolLM2-135M-Instruct's)")


def main(args: argparse.Namespace) -> int:
    """Build the workload with the tokenizer and write it to ``args.output``; prints a summary."""
    from idleless.bench.serving import load_tokenizer

    workload = build_copy_workload(load_tokenizer(args.tokenizer))
    out = Path(args.output)
    out.parent.mkdir(parents=True, exist_ok=True)
    out.write_text(json.dumps(workload, indent=1, ensure_ascii=False) + "\n", encoding="utf-8")
    s = workload["stats"]
    print(f"wrote {out}: {workload['n_requests']} requests {s['requests_by_kind']}, {s['total_prompt_tokens']} prompt "
          f"tokens ({s['prompt_tokens_min']}-{s['prompt_tokens_max']} each), {s['total_max_tokens']} max new tokens")
    return 0

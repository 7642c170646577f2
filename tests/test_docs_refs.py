"""Every code reference in the docs resolves: docs/*.md, README.md, and the docstrings and comments of pymoe/,
cuda_kernels/, tests/ and bench/ (this file's own examples aside).

A reader who follows `cache.HostPool` or `pymoe/engine/kv.py` from a page or a comment must land on something that
exists. The code is read, never imported (no Numba, no GPU): each module's names come from its syntax tree. What
counts as a reference, and what it must resolve to:

  file paths     `pymoe/engine/kv.py`, `tests/test_cache.py`, `tools/train-demo-model`, `docs/formats.md` (from the
                 repository root); `backends/cpu.py`, `engine/grammar.py` (from inside a package root such as
                 pymoe/; only with a dot or a trailing slash, since prose has `experts/step`); a bare `qact.py`
                 or `formats.md` (some file of that name in the repository, or in Python's standard library); a
                 Markdown link's target (from the page's folder). It must exist. A path ending in `.name` that is
                 not a file (`experts/cache.lookup`, `engine/model.Model.new_kv`) is a module and names in it,
                 checked as below.
  path:NAME      `pymoe/quant/repack.py:tile_matmul` or `repack.py:120`: the file exists and defines NAME, or has
                 that many lines.
  module.name    a dotted chain whose first part is `pymoe`, the last part of a pymoe module's dotted name
                 (`cache`, `repack`, `quant`; a short name shared by several modules matches any of them) or a
                 few trailing parts of it (`backends.reference.rmsnorm`): the next part must be *defined* in that
                 module: a function, class or assignment at its top level, a submodule, a name a package's
                 __init__ imports, a dunder (`pymoe.__file__`), or, as shorthand, a member of a class the module
                 defines (`cache.lookup`) or a function nested anywhere in it (`qact.group_scales_at`). A name the
                 module only imports (`cache.HostPool`) does not count: that is not where it lives. Two pymoe
                 modules share their names with libraries (NAMESAKES): `gguf.dequantize` may be gguf-py's.
  Class.member   a chain whose first part is a class defined in pymoe (`SlotCache.lookup`): the member is a
                 method, class attribute, dataclass field or `self.` attribute of the class or of its pymoe bases.
  page "Section" `docs/expert-cache.md, "Which default"`: the page exists and has a heading that holds the quoted
                 words (case aside).
  `ClassName`    on a page, a code span holding one CamelCase name: a name pymoe defines, a Python builtin, or one
                 of the few other libraries' names the pages use (EXTERNAL_NAMES).

Not references (left alone): GGUF metadata keys that do not resolve as code (`tokenizer.ggml.pre`,
`{arch}.attention.head_count`: a key gguf-py's Keys name or a string pymoe's code spells), file names
with a data extension (`model.gguf`), chains through other libraries (`np.float32`, `numba.cuda`), patterns
(`qact.row_dot_*`), JavaScript names (`pymoe.apiKey`: camelCase), and the files of other projects that the docs name
on purpose (EXTERNAL_FILES).
"""
import ast
import builtins
import configparser
import importlib
import os
import re
import sysconfig
import tokenize

import pytest

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
SKIP_DIRS = {".git", ".venv", "build", "dist", "__pycache__", "node_modules", ".pytest_cache", ".hypothesis"}
TOP_DIRS = ("pymoe", "cuda_kernels", "tests", "bench", "tools", "scripts", "docs", ".ci")
# File names of other projects that pages cite as the definition of something (llama.cpp, gguf-py, llm.c, ...).
EXTERNAL_FILES = {"convert_hf_to_gguf.py", "base.py", "quants.py", "ggml-quants.c", "run.c", "train_gpt2.c",
                  "expert_cache.py", "gpt2.py", "qwen3vl.cpp", "clip.cpp"}
# CamelCase names of other libraries and formats that pages put in code spans.
EXTERNAL_NAMES = {"GGUFReader": "gguf", "GGUFWriter": "gguf", "ImmutableSandboxedEnvironment": "jinja2.sandbox",
                  "Allow": "an HTTP header", "Origin": "an HTTP header", "Authorization": "an HTTP header",
                  "Infinity": "JSON", "NaN": "JSON", "Qwen2VLImageProcessor": "transformers"}
# Files pymoe's commands write, named in pages as what a command produces (`pymoe report -o report.md`).
OUTPUT_FILES = {"report.md"}
# pymoe modules named like a library they use: `gguf.dequantize` may be gguf-py's, `cuda.jit` Numba's. Such a chain
# resolves in pymoe or in the library. None: the library is not imported here, so its chains go unchecked (importing
# numba.cuda fixes simulator or driver for the whole process, which the CUDA tests choose: tests/cuda_sim.py).
NAMESAKES = {"gguf": "gguf", "cuda": None}
STDLIB = sysconfig.get_paths()["stdlib"]
# Extensions that make `word.ext` a file name, never `module.attribute`.
FILE_EXTS = {"py", "md", "gguf", "npz", "npy", "bin", "json", "html", "txt", "cfg", "png", "svg", "so", "c", "h",
             "cpp", "cu", "log", "csv", "toml", "yaml", "yml", "jinja", "sh", "pt", "safetensors", "zip", "gz"}


# ---------------------------------------------------------------------------------------------------------------
# The index: every pymoe module (dotted name -> file), what each defines, every class and its members.
# ---------------------------------------------------------------------------------------------------------------

def package_roots() -> dict:
    """{'pymoe': 'pymoe', 'pymoe.cuda_kernels': 'cuda_kernels', ...}: setup.cfg's package_dir plus pymoe/ itself."""
    roots = {"pymoe": "pymoe"}
    cfg = configparser.ConfigParser()
    cfg.read(os.path.join(ROOT, "setup.cfg"))
    for line in cfg.get("options", "package_dir", fallback="").splitlines():
        if "=" in line:
            name, path = (s.strip() for s in line.split("=", 1))
            if name:
                roots[name] = path
    return roots


def walk_files(top: str):
    for dirpath, dirnames, filenames in os.walk(top):
        dirnames[:] = sorted(d for d in dirnames if d not in SKIP_DIRS and not d.endswith(".egg-info"))
        for f in sorted(filenames):
            yield os.path.join(dirpath, f)


def python_files() -> dict:
    """dotted module name -> path of its .py file (packages by their __init__.py)."""
    mods = {}
    for dotted, rel in package_roots().items():
        base = os.path.join(ROOT, rel)
        for path in walk_files(base):
            if not path.endswith(".py"):
                continue
            parts = os.path.relpath(path, base)[:-3].split(os.sep)
            if parts[-1] == "__init__":
                parts = parts[:-1]
            mods[".".join([dotted] + parts)] = path
    return mods


def _targets(node):
    if isinstance(node, ast.Name):
        yield node.id
    elif isinstance(node, (ast.Tuple, ast.List)):
        for elt in node.elts:
            yield from _targets(elt)


def _top_level(body):
    """Statements at a module's or class's top level, through if/try/with blocks but not into functions."""
    for node in body:
        yield node
        for field in ("body", "orelse", "finalbody", "handlers"):
            if not isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef, ast.ClassDef)):
                yield from _top_level(getattr(node, field, []) or [])


def _defined(body, with_imports: bool) -> set:
    names = set()
    for node in _top_level(body):
        if isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef, ast.ClassDef)):
            names.add(node.name)
        elif isinstance(node, ast.Assign):
            for t in node.targets:
                names.update(_targets(t))
        elif isinstance(node, (ast.AnnAssign, ast.AugAssign)):
            names.update(_targets(node.target))
        elif with_imports and isinstance(node, (ast.Import, ast.ImportFrom)):
            names.update((a.asname or a.name).split(".")[0] for a in node.names)
    return names


def defined_anywhere(src: str) -> set:
    """Every function and class name in a module's source, at any depth, and its top-level assignments."""
    tree = ast.parse(src)
    names = _defined(tree.body, with_imports=False)
    names.update(n.name for n in ast.walk(tree) if isinstance(n, (ast.FunctionDef, ast.AsyncFunctionDef, ast.ClassDef)))
    return names


class Index:
    def __init__(self):
        self.files = python_files()                 # dotted -> path
        self.defs = {}                              # dotted -> names defined at top level (+ submodules)
        self.class_members = {}                     # dotted -> members of its classes, functions nested anywhere
        self.classes = {}                           # class name -> [(members, base names)]
        self.literals = set()                       # every string constant in pymoe (GGUF keys among them)
        self.gguf_keys = None                       # built on first use (is_gguf_key)
        for dotted, path in self.files.items():
            with open(path, encoding="utf-8") as f:
                src = f.read()
            tree = ast.parse(src, path)
            is_pkg = path.endswith("__init__.py")
            self.defs[dotted] = _defined(tree.body, with_imports=is_pkg)
            members = self.class_members[dotted] = set()
            for node in ast.walk(tree):
                if isinstance(node, ast.ClassDef):
                    own = _defined(node.body, with_imports=False)
                    for sub in ast.walk(node):
                        if (isinstance(sub, ast.Attribute) and isinstance(sub.ctx, ast.Store)
                                and isinstance(sub.value, ast.Name) and sub.value.id == "self"):
                            own.add(sub.attr)
                    bases = [b.id if isinstance(b, ast.Name) else getattr(b, "attr", "") for b in node.bases]
                    self.classes.setdefault(node.name, []).append((own, bases))
                    members |= own
                elif isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef)):
                    members.add(node.name)
                elif isinstance(node, ast.Constant) and isinstance(node.value, str) and len(node.value) < 80:
                    self.literals.add(node.value)
        for dotted in self.files:
            parent, _, leaf = dotted.rpartition(".")
            if parent in self.defs:
                self.defs[parent].add(leaf)
        self.by_suffix = {}                         # "cache", "experts.cache", "pymoe.experts.cache" -> [dotted]
        for dotted in self.files:
            parts = dotted.split(".")
            for i in range(len(parts)):
                self.by_suffix.setdefault(".".join(parts[i:]), []).append(dotted)

    def members_of(self, cls: str, seen=()) -> set:
        out = set()
        for own, bases in self.classes.get(cls, []):
            out |= own
            for b in bases:
                if b in self.classes and b not in seen:
                    out |= self.members_of(b, seen + (cls,))
        return out

    def resolve_chain(self, chain: str):
        """None if `chain` is not a pymoe reference; else '' when it resolves, or why it does not."""
        why = self._resolve(chain)
        library = NAMESAKES.get(chain.split(".")[0], "")
        if why and library != "" and (library is None or library_has(library, chain)):
            return ""
        return why

    def _resolve(self, chain: str):
        parts = chain.split(".")
        if parts[0] in self.classes and parts[0] not in self.by_suffix:
            if len(parts) == 1 or parts[1] in self.members_of(parts[0]):
                return ""
            return f"class {parts[0]} has no member {parts[1]!r}"
        # the longest leading run of parts that names a module
        for n in range(len(parts), 0, -1):
            mods = self.by_suffix.get(".".join(parts[:n]))
            if mods:
                break
        else:
            return None
        if n == len(parts):
            return ""
        name = parts[n]
        if name.startswith("__") and name.endswith("__"):
            return ""  # __file__, __version__
        for m in mods:
            if name in self.defs[m]:
                if len(parts) == n + 1 or parts[n + 1] in self.members_of(name) or name not in self.classes:
                    return ""
            elif len(parts) == n + 1 and name in self.class_members[m]:
                return ""
        where = ", ".join(self.files[m].replace(ROOT + os.sep, "") for m in mods)
        if len(parts) > n + 1 and any(name in self.defs[m] for m in mods):
            return f"{name} in {where} has no member {parts[n + 1]!r}"
        return f"{where} defines no {name!r}"

    def is_gguf_key(self, chain: str) -> bool:
        """`tokenizer.ggml.pre`, `attention.key_length` (`{arch}.` left out), or the start of one (`tokenizer.ggml`): a
        key gguf-py's Keys name, or one pymoe's code spells (a string literal, `f"{arch}.attention.recurrent_layers"`
        included)."""
        if self.gguf_keys is None:
            self.gguf_keys = {s.lstrip(".") for s in self.literals if "." in s}
            try:
                from gguf.constants import Keys
            except ImportError:
                Keys = None
            stack = [Keys] if Keys is not None else []
            while stack:
                for v in vars(stack.pop()).values():
                    if isinstance(v, str) and "." in v:
                        self.gguf_keys.add(v.replace("{arch}.", ""))
                    elif isinstance(v, type):
                        stack.append(v)
        return any(k == chain or k.startswith(chain + ".") for k in self.gguf_keys)

    def module_for_path(self, rel: str):
        """'pymoe/experts/cache' or 'cuda_kernels/moe' (no extension) -> dotted module name, or None."""
        for dotted, path in self.files.items():
            p = os.path.relpath(path, ROOT)[:-3]
            if p == rel or p == rel + "/__init__":
                return dotted
        return None


def library_has(library: str, chain: str) -> bool:
    """Whether `library` (importable) has the attributes chain's parts after the first name; True if it will not
    import (nothing to check against)."""
    try:
        obj = importlib.import_module(library)
    except Exception:
        return True
    for part in chain.split(".")[1:]:
        if not hasattr(obj, part):
            return False
        obj = getattr(obj, part)
    return True


@pytest.fixture(scope="module")
def index():
    return Index()


# ---------------------------------------------------------------------------------------------------------------
# Where references are: Markdown pages (code spans, links, prose) and pymoe's docstrings and comments.
# ---------------------------------------------------------------------------------------------------------------

def markdown_pages():
    pages = [os.path.join(ROOT, "README.md")]
    pages += sorted(p for p in walk_files(os.path.join(ROOT, "docs")) if p.endswith(".md"))
    return pages


def python_texts():
    """(path, line, text) for every comment and docstring of the packages, the tests and the benchmarks."""
    for rel in [*package_roots().values(), "tests", "bench"]:
        for path in walk_files(os.path.join(ROOT, rel)):
            if not path.endswith(".py") or os.path.samefile(path, __file__):
                continue
            with open(path, encoding="utf-8") as f:
                src = f.read()
            with open(path, encoding="utf-8") as f:
                for tok in tokenize.generate_tokens(f.readline):
                    if tok.type == tokenize.COMMENT:
                        yield path, tok.start[0], tok.string
            for node in ast.walk(ast.parse(src, path)):
                if isinstance(node, (ast.Module, ast.ClassDef, ast.FunctionDef, ast.AsyncFunctionDef)):
                    if (node.body and isinstance(node.body[0], ast.Expr)
                            and isinstance(node.body[0].value, ast.Constant)
                            and isinstance(node.body[0].value.value, str)):
                        doc = node.body[0].value
                        # one entry per line, so that a failure names the line
                        for i, line in enumerate(doc.value.splitlines()):
                            yield path, doc.lineno + i, line


PKG_DIRS = ("backends", "engine", "experts", "gguf", "quant", "serve", "demo", "cuda_kernels")
# From the repository root, always; from inside a package (`engine/grammar.py`), only with a dot or a trailing slash,
# since prose has `experts/step`.
PATH_RE = re.compile(r"(?<![\w./-])((?:%s)/[\w./-]*[\w/]|(?:%s)/[\w/-]*(?:\.[\w./-]*\w|/))"
                     % ("|".join(re.escape(d) for d in TOP_DIRS), "|".join(PKG_DIRS)))
LOCATION_RE = re.compile(r"(?<![\w./-])([\w/.-]*\w\.py):(\w+)")
BARE_FILE_RE = re.compile(r"(?<![\w./-])([\w-]+\.(?:py|md))\b(?![\w/-]|\.\w)")
CHAIN_RE = re.compile(r"(?<![\w./{}-])([A-Za-z_]\w*(?:\.[A-Za-z_]\w*)+)")
LINK_RE = re.compile(r"\]\(([^()\s]+)\)")
CAMEL_RE = re.compile(r"^[a-z]+[A-Z]")
SECTION_RE = re.compile(r"(?<![\w/.-])([\w/.-]+\.md),? \"([^\"]{3,80})\"")
CLASS_SPAN_RE = re.compile(r"`([A-Z][A-Za-z0-9]*[a-z][A-Za-z0-9]*)`")


class Refs:
    """Collects every reference in one text and checks it against the index."""

    def __init__(self, index, all_files: dict):
        self.index = index
        self.all_files = all_files        # basename -> [repo-relative paths]
        self.problems = []

    def fail(self, where: str, ref: str, why: str):
        self.problems.append(f"{where}: {ref!r}: {why}")

    def path_exists(self, rel: str, bases) -> bool:
        rel = rel.rstrip("/")
        return any(os.path.exists(os.path.join(ROOT, b, rel)) for b in bases)

    def check_path(self, where: str, rel: str):
        if "*" in rel or "{" in rel:
            return
        bases = ["", *package_roots().values()]
        if self.path_exists(rel, bases):
            return
        # `experts/cache.lookup`, `engine/model.Model.new_kv`: a module path, then a chain of names in it
        folder, _, last = rel.rpartition("/")
        stem, dot, names = last.partition(".")
        if dot and names.split(".")[0] not in FILE_EXTS and "/" not in names:
            for b in bases:
                dotted = self.index.module_for_path(os.path.normpath(os.path.join(b, folder, stem)))
                if dotted:
                    why = self.index.resolve_chain(dotted + "." + names)
                    if why:
                        self.fail(where, rel, why)
                    return
        # `gguf/loader` in prose: a module path without its extension
        if self.path_exists(rel + ".py", bases):
            return
        self.fail(where, rel, "no such file or folder")

    def check_location(self, where: str, file: str, what: str):
        """`path.py:NAME` (a function, class or assignment anywhere in the file) or `path.py:LINE` (within it)."""
        bases = ["", *package_roots().values()]
        rels = [file] if "/" in file else self.all_files.get(file, [])
        found = [os.path.join(ROOT, b, r) for r in rels for b in bases if os.path.isfile(os.path.join(ROOT, b, r))]
        for full in found:  # (a file that is not there is reported as a path)
            with open(full, encoding="utf-8") as f:
                src = f.read()
            if what.isdigit():
                if int(what) <= src.count("\n") + 1:
                    return
            elif what in defined_anywhere(src):
                return
        if found:
            self.fail(where, f"{file}:{what}", "not in that file")

    def check_section(self, where: str, page: str, section: str):
        """`docs/server.md, "Limits"`: a heading of that page holds the quoted words."""
        rels = [page] if "/" in page else self.all_files.get(page, [])
        found = [os.path.join(ROOT, r) for r in rels if os.path.isfile(os.path.join(ROOT, r))]
        for full in found:  # (a page that is not there is reported as a path)
            with open(full, encoding="utf-8") as f:
                if any(line.startswith("#") and section.lower() in line.lower() for line in f):
                    return
        if found:
            self.fail(where, f'{page} "{section}"', "no heading of that page holds these words")

    def check_text(self, where: str, text: str, page: str = None):
        for m in LOCATION_RE.finditer(text):
            self.check_location(where, m.group(1), m.group(2))
        for m in PATH_RE.finditer(text):
            self.check_path(where, m.group(1))
        for m in SECTION_RE.finditer(text):
            self.check_section(where, m.group(1), m.group(2))
        for m in BARE_FILE_RE.finditer(text):
            name = m.group(1)
            if (name not in self.all_files and name not in EXTERNAL_FILES and name not in OUTPUT_FILES
                    and not os.path.exists(os.path.join(STDLIB, name))):
                self.fail(where, name, "no file of that name in the repository")
        for m in CHAIN_RE.finditer(text):
            chain = m.group(1)
            if text[m.end():m.end() + 1] in ("/", "*"):
                continue  # a path (`experts/cache.py/`), a pattern (`qact.row_dot_*`)
            parts = chain.split(".")
            if parts[1] in FILE_EXTS or any(CAMEL_RE.match(p) for p in parts):
                continue  # a file name (`model.gguf`); JavaScript (`pymoe.apiKey`, the monitor page's)
            why = self.index.resolve_chain(chain)
            if why and not self.index.is_gguf_key(chain):
                self.fail(where, chain, why)
        if page:
            for m in CLASS_SPAN_RE.finditer(text):
                name = m.group(1)
                if not (name in self.index.classes or name in EXTERNAL_NAMES or hasattr(builtins, name)
                        or any(name in d for d in self.index.defs.values())):
                    self.fail(where, name, "pymoe defines no such name")
            for m in LINK_RE.finditer(text):
                target = m.group(1).split("#")[0]
                if not target or re.match(r"^[a-z]+:", target):
                    continue
                if not os.path.exists(os.path.normpath(os.path.join(os.path.dirname(page), target))):
                    self.fail(where, target, "link target does not exist")


def repository_files() -> dict:
    out = {}
    for top in TOP_DIRS + ("",):
        base = os.path.join(ROOT, top)
        if not os.path.isdir(base):
            continue
        walker = walk_files(base) if top else (os.path.join(ROOT, f) for f in os.listdir(ROOT))
        for path in walker:
            if os.path.isfile(path):
                out.setdefault(os.path.basename(path), []).append(os.path.relpath(path, ROOT))
    return out


def _markdown_problems(index):
    refs = Refs(index, repository_files())
    for page in markdown_pages():
        with open(page, encoding="utf-8") as f:
            for n, line in enumerate(f, 1):
                refs.check_text(f"{os.path.relpath(page, ROOT)}:{n}", line, page=page)
    return refs.problems


def _python_problems(index):
    refs = Refs(index, repository_files())
    for path, line, text in python_texts():
        refs.check_text(f"{os.path.relpath(path, ROOT)}:{line}", text)
    return refs.problems


def test_markdown_references_resolve(index):
    problems = _markdown_problems(index)
    assert not problems, "stale references in the docs:\n" + "\n".join(problems)


def test_docstring_and_comment_references_resolve(index):
    problems = _python_problems(index)
    assert not problems, "stale references in docstrings and comments:\n" + "\n".join(problems)


def test_the_checker_catches_what_it_should(index):
    """The rules themselves: a stale reference of each kind is reported, a live one and a non-reference are not."""
    refs = Refs(index, repository_files())
    live = ["`pymoe/engine/kv.py`", "backends/cpu.py", "`cache.expert`", "SlotCache.lookup", "experts/cache.lookup",
            "pymoe.backends.pool.HostPool", "`repack.py`", "tokenizer.ggml.pre", "model.gguf", "np.float32",
            "pymoe/experts/cache.py:SlotCache", "cache.py:10", "tests/test_cache.py:reference_tokens",
            "backends/cpu.py:attention_rows", "see e.g. the docs", "8 experts/step",
            "`qact.row_dot_*`", "`pymoe.apiKey`", "gguf.dequantize", "engine/model.Model.new_kv", "bz2.py",
            "`SlotCache`", "`GGUFReader`", "`MemoryError`", "[a link](README.md)",
            'docs/server.md, "Limits"', 'expert-cache.md "which default"']
    for text in live:
        refs.check_text("live", text, page=os.path.join(ROOT, "docs", "x.md"))
    assert refs.problems == []
    stale = ["`pymoe/engine/kvcache.py`", "`SlotTables`", "moe.route", "cache.HostPool", "model.rmsnorm",
             "SlotCache.lookups", "experts/cache.lookup_all", "nosuchfile.py", "pymoe/experts/cache.py:HostPool",
             "cache.py:100000", "[a link](nowhere/)", "attention.gqa_blokc", "`tokenizer.ggml.nonsense_key`",
             'docs/server.md, "Round twelve"']
    for text in stale:
        before = len(refs.problems)
        refs.check_text("stale", text, page=os.path.join(ROOT, "docs", "x.md"))
        assert len(refs.problems) == before + 1, text

"""Every reference in README.md, CONTRIBUTING.md and docs/*.md resolves in the checkout: a file path
(`diloco/outer/sync.py`, `results/overlap/trainer/README.md`), a `file.py:LINE` (the file has that
line), a `tests/x.py::test_name`, and a code name in backticks: dotted from the package
(`diloco.outer.sync.OuterSync`), a project class's member (`Layout.in_rules`, `OuterSync.exchange`)
or a project module's name (`agent.main`, `sync.OuterSync`); a relative markdown link's file; a
`--config.key=` of experiments/base.py; a `DILOCO_*` variable the code reads; a `diloco <command>` of
diloco/cli.py; and no history ("before #30", "used to": CHANGELOG.md's). Pure Python, nothing imported."""
from __future__ import annotations

import ast
import re
from functools import lru_cache

from conftest import REPO

DOCS = ["README.md", "CONTRIBUTING.md", *sorted(p.relative_to(REPO).as_posix() for p in (REPO / "docs").glob("*.md"))]
TOP = ("diloco", "tests", "docs", "experiments", "sweeps", "benchmarks", "scripts", "results", ".ci")
PATH = re.compile(r"(?<![\w./-])((?:%s)/[\w./*{},+-]*[\w*}])(?::(\d+)(?:[–-](\d+))?|::(\w+))?" % "|".join(
    re.escape(t) for t in TOP))
CODE = re.compile(r"`([^`\n]+)`")
NAME = re.compile(r"^([A-Za-z_]\w*(?:\.[A-Za-z_]\w*)+)(?:\(.*\))?$")
ENV = re.compile(r"\bDILOCO_[A-Z0-9_]*[A-Z0-9]\b")
FLAG = re.compile(r"--config\.([\w.]+)=")
COMMAND = re.compile(r"`diloco ([a-z][a-z_]*)(?=[\s`]|$)(?! \d)")  # in code, not prose …
CODE_LINE = re.compile(r"^\s*(?:\$ )?diloco ([a-z][a-z_]*)(?=\s|$)(?! \d)")  # … or a line of a code block
MDLINK = re.compile(r"\]\(([^)#\s]+)(?:#[^)\s]*)?\)")
HISTORY = re.compile(r"(?<![\w/.])#\d{2,}\b|\bused to\b|\buntil 20\d\d\b|\bArchived\b|\bthe code before\b")  # → CHANGELOG


class Index:
    """Every module of diloco/ by dotted name, its top-level names, and every class's members."""

    def __init__(self, root):
        self.modules: dict[str, set[str]] = {}
        self.classes: dict[str, list[tuple[set[str], list[str]]]] = {}  # name → [(members, bases)]
        for f in sorted((root / "diloco").rglob("*.py")):
            parts = f.relative_to(root).with_suffix("").parts
            mod = ".".join(parts[:-1] if parts[-1] == "__init__" else parts)
            tree = ast.parse(f.read_text())
            names = set()
            for node in tree.body:
                names |= self.bound(node)
                if isinstance(node, ast.Assign) and any(isinstance(t, ast.Name) and t.id == "__all__" for t in node.targets):
                    names |= {e.value for e in ast.walk(node.value) if isinstance(e, ast.Constant)}
            for node in ast.walk(tree):
                if isinstance(node, ast.ClassDef):
                    members = set().union(*(self.bound(n) for n in node.body)) if node.body else set()
                    for sub in ast.walk(node):  # self.x = … in any method
                        if isinstance(sub, (ast.Assign, ast.AnnAssign)):
                            for t in sub.targets if isinstance(sub, ast.Assign) else [sub.target]:
                                for e in ast.walk(t):
                                    if isinstance(e, ast.Attribute) and isinstance(e.value, ast.Name) and e.value.id == "self":
                                        members.add(e.attr)
                    bases = [b.id if isinstance(b, ast.Name) else b.attr for b in node.bases
                             if isinstance(b, (ast.Name, ast.Attribute))]
                    self.classes.setdefault(node.name, []).append((members, bases))
                    names |= members  # `placement.step`: a member of one of the module's classes
            self.modules[mod] = names
        for mod in list(self.modules):  # subpackages are names of their package
            if "." in mod:
                self.modules.setdefault(mod.rsplit(".", 1)[0], set()).add(mod.rsplit(".", 1)[1])
        self.config: dict[str, set[str]] = {}  # `outer.lr`: section → keys of the base config
        for node in ast.walk(ast.parse((root / "experiments" / "base.py").read_text())):
            if (isinstance(node, ast.Assign) and isinstance(node.targets[0], ast.Attribute)
                    and isinstance(node.value, ast.Call) and node.value.args
                    and isinstance(node.value.args[0], ast.Call)):
                self.config[node.targets[0].attr] = {k.arg for k in node.value.args[0].keywords}
        self.top = {n.targets[0].attr for n in ast.walk(ast.parse((root / "experiments" / "base.py").read_text()))
                    if isinstance(n, ast.Assign) and isinstance(n.targets[0], ast.Attribute)}
        code = [f for d in ("diloco", "scripts", "benchmarks", "tests/standin", ".ci") for f in (root / d).rglob("*")
                if f.is_file() and f.suffix in (".py", ".sh", "")]
        self.env = set().union(*(set(ENV.findall(f.read_text(errors="replace"))) for f in code))
        cli = ast.parse((root / "diloco" / "cli.py").read_text())
        self.commands = {k.value for n in ast.walk(cli) if isinstance(n, ast.AnnAssign) and
                         getattr(n.target, "id", "") == "COMMANDS" for k in n.value.keys}
        self.basenames: dict[str, list[str]] = {}
        for mod in self.modules:
            self.basenames.setdefault(mod.rsplit(".", 1)[-1], []).append(mod)

    @staticmethod
    def bound(node) -> set[str]:
        if isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef, ast.ClassDef)):
            return {node.name}
        if isinstance(node, (ast.Import, ast.ImportFrom)):
            return {(a.asname or a.name).split(".")[0] for a in node.names}
        targets = node.targets if isinstance(node, ast.Assign) else [node.target] if isinstance(node, ast.AnnAssign) else []
        out = {e.id for t in targets for e in ast.walk(t) if isinstance(e, ast.Name)}
        if isinstance(node, (ast.If, ast.Try)):  # names bound under `if TYPE_CHECKING` / try-import
            for sub in ast.iter_child_nodes(node):
                out |= Index.bound(sub)
        return out

    def member(self, cls: str, attr: str, seen=()) -> bool | None:
        """Whether project class `cls` (or one of its bases) has `attr`; None if no such class."""
        if cls not in self.classes or cls in seen:
            return None
        for members, bases in self.classes[cls]:
            if attr in members or any(self.member(b, attr, (*seen, cls)) for b in bases):
                return True
        return False

    def resolves(self, name: str) -> bool | None:
        """True/False for a name this index can judge, None for one it cannot (another library's)."""
        parts = name.split(".")
        if parts[0] == "diloco":
            for i in range(len(parts), 0, -1):  # the longest module prefix, then names inside it
                mod = ".".join(parts[:i])
                if mod in self.modules:
                    rest = parts[i:]
                    if not rest:
                        return True
                    if rest[0] not in self.modules[mod]:
                        return False
                    return len(rest) == 1 or self.member(rest[0], rest[1]) is not False
            return False
        if parts[0] in self.config and len(parts) == 2:  # a config key
            return parts[1] in self.config[parts[0]]
        if parts[0][:1].isupper():  # Class.member
            return self.member(parts[0], parts[1])
        if parts[0] in self.basenames and len(parts[0]) > 2:  # module.name
            mods = self.basenames[parts[0]]
            if any(parts[1] in self.modules[m] for m in mods):
                return True
            return False if not self.stdlib_like(parts[0]) else None
        return None

    @staticmethod
    def stdlib_like(name: str) -> bool:  # project modules that share a name with a library's
        return name in {"config", "data", "eval", "model", "compile", "distributed", "simulate", "report",
                        "sharding", "checkpoint", "errors", "sweep", "launch", "overlap", "methods", "codecs"}


@lru_cache(maxsize=1)
def index() -> Index:
    return Index(REPO)


def bad_references(text: str, where: str, root=REPO, idx: Index | None = None, folder: str = "",
                   code: bool = False) -> list[str]:
    """The references of `text` (a line of a page in `folder`; `code`: inside a code block) that do not
    resolve under `root`, as 'where: reference (why)'."""
    idx = idx or index()
    bad = []
    bad += [f"{where}: {h} (history belongs in CHANGELOG.md)" for h in HISTORY.findall(text)]
    for target in MDLINK.findall(text):
        if not re.match(r"[a-z]+:", target) and not (root / folder / target).exists():
            bad.append(f"{where}: ({target}) (no such file)")
    for key in set(FLAG.findall(text)) - {"key", "KEY"}:  # `--config.key=value`: a placeholder
        parts = key.split(".")
        if not (parts[0] in idx.top and (len(parts) == 1 or parts[1] in idx.config.get(parts[0], ()))):
            bad.append(f"{where}: --config.{key} (no such key in experiments/base.py)")
    bad += [f"{where}: {v} (no code reads it)" for v in ENV.findall(text) if v not in idx.env]
    commands = COMMAND.findall(text) + (CODE_LINE.findall(text) if code or text.startswith("    ") else [])
    bad += [f"{where}: diloco {c} (no such command in diloco/cli.py)" for c in commands if c not in idx.commands]
    for m in PATH.finditer(text):
        path, line, end, test = m.group(1).rstrip("."), m.group(2), m.group(3), m.group(4)
        if any(c in path for c in "*{"):  # a glob or a brace list: its fixed folder must exist
            head = re.split(r"[*{]", path)[0].rsplit("/", 1)[0]
            if not (root / head).exists():
                bad.append(f"{where}: {path} (no folder {head})")
            continue
        if not (root / path).exists():
            bad.append(f"{where}: {path} (no such file)")
            continue
        if line and (root / path).is_file():
            n = len((root / path).read_text(errors="replace").splitlines())
            if int(end or line) > n:
                bad.append(f"{where}: {path}:{line} (the file has {n} lines)")
        if test and path.endswith(".py") and not re.search(rf"^\s*(?:async )?def {test}\b|^class {test}\b",
                                                          (root / path).read_text(), re.M):
            bad.append(f"{where}: {path}::{test} (no such test)")
    for m in CODE.finditer(text):
        tok = m.group(1).strip()
        n = NAME.match(tok)
        if not n or "/" in tok or tok.endswith((".py", ".md", ".json", ".jsonl", ".csv", ".txt", ".log", ".png", ".sh", ".toml")):
            continue
        if idx.resolves(n.group(1)) is False:
            bad.append(f"{where}: `{tok}` (no such name in diloco/)")
    return bad


LINK = re.compile(r"\]\(([^)#\s]*)#([^)\s]+)\)")


def slugs(md: str) -> set[str]:
    """GitHub's anchors of a markdown file's headings."""
    out = set()
    for h in re.findall(r"^#+ (.+)$", md, re.M):
        out.add(re.sub(r"[^\w\- ]", "", h.strip().lower()).replace(" ", "-"))
    return out


def bad_anchors(doc: str) -> list[str]:
    """Links `file.md#anchor` (or `#anchor`) of `doc` whose anchor is no heading of that file."""
    bad = []
    for target, anchor in LINK.findall((REPO / doc).read_text()):
        path = (REPO / doc).parent / target if target else REPO / doc
        if path.suffix == ".md" and path.exists() and anchor not in slugs(path.read_text()):
            bad.append(f"{doc}: {target}#{anchor} (no such heading)")
    return bad


def test_every_reference_in_the_docs_resolves():
    bad = []
    for doc in DOCS:
        fenced = False
        for i, line in enumerate((REPO / doc).read_text().splitlines(), 1):
            fenced ^= line.lstrip().startswith("```")
            bad += bad_references(line, f"{doc}:{i}", folder=str((REPO / doc).parent.relative_to(REPO)), code=fenced)
            bad += [f"{doc}:{i}: {m} (a developer machine's path)" for m in re.findall(r"(?<![\w.])/(?:work|home|Users)/\S+", line)]
        bad += bad_anchors(doc)
    assert bad == [], f"{len(bad)} reference(s) that do not resolve:\n" + "\n".join(bad)


def test_a_wrong_reference_is_caught():
    """The check can fail: each kind of wrong reference below is reported, each right one is not."""
    wrong = ["`diloco/outer/nothing.py`", "diloco/outer/sync.py:99999", "tests/test_docs.py::test_no_such_test",
             "`diloco.outer.sync.NoSuchThing`", "`Layout.no_such_member`", "`sync.no_such_function`",
             "`outer.no_such_key`", "[x](no_such_page.md)", "--config.outer.no_such=1", "--config.no_such=1",
             "DILOCO_NO_SUCH_VARIABLE", "`diloco no_such_command --x`", "as before #30", "it used to"]
    right = ["`diloco/outer/sync.py`", "diloco/outer/sync.py:1", "tests/test_docs.py::test_a_wrong_reference_is_caught",
             "`diloco.outer.sync.OuterSync`", "`Layout.in_rules`", "`jax.lax.psum`", "`optax.sgd`",
             "`outer.lr`", "`placement.step`", "`diloco.model.param_logical_axes`", "[x](README.md)",
             "[x](https://example.com/a.md)", "--config.outer.lr=1", "--config.tau=2", "DILOCO_CACHE",
             "`diloco train --config x`", "    diloco host 3/4: devices", "diloco and its tests",
             "[x](docs/distributed.md#10-a-slurm-cluster)"]
    assert bad_references("diloco no_such_command --x", "x", code=True)  # a line of a code block
    assert not bad_references("diloco and its tests", "x", code=False)
    assert [bool(bad_references(r, "x")) for r in wrong] == [True] * len(wrong)
    assert [r for r in right if bad_references(r, "x")] == []
    assert "code-map-read-15-first" in slugs((REPO / "README.md").read_text())  # how README's anchors are spelt
    assert "code-map" not in slugs((REPO / "README.md").read_text())

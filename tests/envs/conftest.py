"""Fixtures of the environment tests: an offline stand-in for NLTK's `words` corpus, verifiers' example
environments importable by their package names."""

from __future__ import annotations

from pathlib import Path

import pytest

EXAMPLES = Path(__file__).parent / "vf_examples"


def make_words_corpus(root: Path, words: list[str]) -> Path:
    """NLTK's `words` corpus layout (`corpora/words/{en,en-basic}`, one word a line) under `root`: textarena's
    Hangman draws its word from it; the real corpus cannot be downloaded here."""
    corpus = root / "corpora" / "words"
    corpus.mkdir(parents=True, exist_ok=True)
    for name in ("en", "en-basic"):
        (corpus / name).write_text("\n".join(words) + "\n")
    (corpus / "README").write_text("stand-in word list built by the tests\n")
    return root


@pytest.fixture(scope="session")
def words_corpus_root(tmp_path_factory) -> Path:
    """One corpus directory for the whole session: NLTK binds its `words` reader to the directory it first loads
    from and later refuses that directory once it is off `nltk.data.path` (its path security), so every test
    must name the same one."""
    return make_words_corpus(tmp_path_factory.mktemp("nltk_data"), ["apple"])


@pytest.fixture
def offline_words(words_corpus_root, monkeypatch):
    """Hangman's word list: one word, so a scripted player can win."""
    import nltk

    root = words_corpus_root
    monkeypatch.setenv("NLTK_DATA", str(root))
    monkeypatch.setattr(nltk.data, "path", [str(root), *nltk.data.path])
    return ["apple"]


@pytest.fixture
def vf_examples(monkeypatch):
    """verifiers' repository example envs (tests/envs/vf_examples) importable as installed packages."""
    monkeypatch.syspath_prepend(str(EXAMPLES))
    return EXAMPLES

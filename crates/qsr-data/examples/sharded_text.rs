//! A character-level corpus through the per-worker text windows: the embedded Comedy of Errors (or all
//! of Shakespeare with `--shakespeare [DIR]`, after `bash scripts/fetch-shakespeare.sh`), its vocabulary,
//! split and unigram entropy, and the first window each of 2 workers draws at step 0.
//!
//! ```sh
//! cargo run --release -p qsr-data --example sharded_text
//! ```

use qsr_data::{Corpus, SHAKESPEARE_DEFAULT_DIR, TextWindows};

fn main() -> Result<(), qsr_data::DataError> {
    let args: Vec<String> = std::env::args().skip(1).collect();
    let corpus = match args.first().map(String::as_str) {
        Some("--shakespeare") => Corpus::shakespeare(args.get(1).map_or(SHAKESPEARE_DEFAULT_DIR, String::as_str))?,
        _ => Corpus::comedy_of_errors(),
    };
    println!(
        "{}: {} characters in its vocabulary, {} training and {} validation tokens, unigram entropy {:.3} nats",
        corpus.name(),
        corpus.vocab().len(),
        corpus.train().len(),
        corpus.valid().len(),
        corpus.unigram_entropy()
    );
    for rank in 0..2 {
        let batch = TextWindows::new(&corpus, (64, 1), 0, rank, 2)?.batch(0);
        println!("rank {rank}, step 0: {:?}", corpus.vocab().decode(&batch.inputs));
    }
    Ok(())
}

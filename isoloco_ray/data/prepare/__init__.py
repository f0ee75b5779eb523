"""Offline preparation: documents in, a prepared token dataset (data/format.py) out.

Training never imports this package, except to prepare the demo corpus on first use
(`documents.ensure_demo_data`). The CLI is `python -m isoloco_ray.data.prepare` (cli.py).

- cli.py: the command line (--demo, --source, --from-npy)
- documents.py: a list of documents in memory -> a dataset (the demo, the tests' corpora);
  demo.py: the demo's sources, fetched and checked
- corpus.py: a real corpus, streamed and resumable: split by a per-document hash, routed and
  packed; sources.py: what it reads (files, Hugging Face datasets)
- tokenizing.py: documents to token ids in batches, the local engine's process pool;
  ray_tokenize.py: the Ray engine (actors); encoding.py: tokenizers (train-bpe, backends)
- packing.py: token streams into fixed-length blocks and shards
- npy_import.py: the research code's .npy token arrays, not re-tokenized
- staging.py: writing through a staging directory, a lock, nothing replaced that is not a
  prepared dataset
"""

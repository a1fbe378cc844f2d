"""Model directories made here, for trying the project without downloading a model:
``tiny`` writes a 2-layer random-weight Llama with its own tokenizer and chat template
(``mooncake-rs make-model DIR``), and the byte-level tokenizer the ``serve`` command gives a
random-weight preset (``serve --model tiny``). Nothing here imports torch until weights
are written."""

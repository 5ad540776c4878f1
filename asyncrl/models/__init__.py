"""Models as the engines and learners hold them: building the tiny random models and loading the
embedded GGUF model or a Hugging Face directory with its tokenizer (`loading`), the value model,
vision-language models' vision tower and image processor (`vision`, over `asyncrl.storage.images`), and
the bfloat16-or-float32 choice measured on this machine (`precision`). Model families the engine's
own decoder runs live beside the other engine code (`asyncrl.engines`). May import the config;
never an engine, a role or the run. Nothing here downloads anything."""

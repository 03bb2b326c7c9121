"""Images in the engine: a prompt's images as the engine carries them (``prompt``), what each model family's
vision tower reads and gives (``families``), the processor that makes a prompt's tokens and pixels without
torchvision (``processor``), the encoder outputs cached by image (``encoder_cache``) and the vision step that puts
them in place of the placeholder tokens before the language model runs (``vision_step``)."""

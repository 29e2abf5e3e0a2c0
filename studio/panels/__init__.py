"""One page per step of the flow: model, data, training, monitor, chat, export, hardware."""

"""The server layer: gRPC for the stages (stage_server, process) and what every gRPC process
shares (grpc_common: health, reflection, signals, drain, channel options)."""

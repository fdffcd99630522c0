"""The CLI layer: `omnistage` commands (main), `omnistage serve` (serve), deployment files
(deploy_render) and protobuf code generation (protogen)."""

"""Generated protobuf/gRPC code for the ``omnistage.v1`` proto package.

Do not edit: the sources are ``protos/omnistage/v1/*.proto``; regenerate with
``python -m omnistage.protogen``.
"""

# meshlimitd: multi-stage build, small non-root runtime image.
FROM rust:1-bookworm AS build
WORKDIR /src
COPY . .
RUN cargo build --release --locked -p meshlimitd

FROM gcr.io/distroless/cc-debian12:nonroot
COPY --from=build /src/target/release/meshlimitd /usr/local/bin/meshlimitd
ENV MESHLIMITD_LISTEN=0.0.0.0:8080
EXPOSE 8080
USER 65532:65532
ENTRYPOINT ["/usr/local/bin/meshlimitd"]

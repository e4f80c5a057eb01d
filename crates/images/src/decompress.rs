//! Decompression of layer blobs: gzip, zstd or none, chosen from the media type or by sniffing
//! the first bytes.
//!
//! Invariant: a truncated or corrupt compressed stream is an error, never a silently shorter
//! tar. gzip checks its trailer (CRC-32 and length) and reports an incomplete deflate stream;
//! zstd reports an incomplete frame. Concatenated gzip members and zstd frames are read whole,
//! as other OCI tools do.

use std::io::{self, BufRead, Read};

/// How a layer blob is compressed.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum Compression {
    None,
    Gzip,
    Zstd,
}

impl Compression {
    /// The compression an OCI or Docker layer media type names; `None` (the `Option`) for a
    /// media type that is not a layer tar.
    pub fn from_media_type(mt: &str) -> Option<Compression> {
        // Parameters (`; foo=bar`) do not change the encoding.
        let mt = mt.split(';').next().unwrap_or_default().trim();
        match mt {
            "application/vnd.oci.image.layer.v1.tar"
            | "application/vnd.oci.image.layer.nondistributable.v1.tar"
            | "application/vnd.docker.image.rootfs.diff.tar" => Some(Compression::None),
            "application/vnd.oci.image.layer.v1.tar+gzip"
            | "application/vnd.oci.image.layer.nondistributable.v1.tar+gzip"
            | "application/vnd.docker.image.rootfs.diff.tar.gzip"
            | "application/vnd.docker.image.rootfs.foreign.diff.tar.gzip" => Some(Compression::Gzip),
            "application/vnd.oci.image.layer.v1.tar+zstd"
            | "application/vnd.oci.image.layer.nondistributable.v1.tar+zstd" => Some(Compression::Zstd),
            _ => None,
        }
    }

    /// Guesses from the first bytes of a blob (at least 4 for zstd): the gzip and zstd magic
    /// numbers, anything else is taken as an uncompressed tar (which the unpacker then
    /// checks).
    pub fn sniff(first_bytes: &[u8]) -> Compression {
        if first_bytes.starts_with(&[0x1f, 0x8b]) {
            Compression::Gzip
        } else if first_bytes.starts_with(&[0x28, 0xb5, 0x2f, 0xfd]) {
            Compression::Zstd
        } else {
            Compression::None
        }
    }
}

/// A reader of the decompressed bytes of `input`.
pub fn decoder<'a, R: BufRead + 'a>(input: R, compression: Compression) -> io::Result<Box<dyn Read + 'a>> {
    Ok(match compression {
        Compression::None => Box::new(input),
        Compression::Gzip => Box::new(flate2::bufread::MultiGzDecoder::new(input)),
        Compression::Zstd => Box::new(zstd::stream::read::Decoder::with_buffer(input)?),
    })
}

#[cfg(test)]
mod tests {
    use super::*;
    use std::io::Write;

    fn payload() -> Vec<u8> {
        // Compressible but not trivial, a few hundred KiB.
        (0..300_000u32).flat_map(|i| (i % 251).to_le_bytes()).collect()
    }

    fn gzip(data: &[u8]) -> Vec<u8> {
        let mut e = flate2::write::GzEncoder::new(Vec::new(), flate2::Compression::fast());
        e.write_all(data).unwrap();
        e.finish().unwrap()
    }

    fn zstd(data: &[u8]) -> Vec<u8> {
        // With a content checksum, as the zstd command line writes by default; without one a
        // flipped literal byte decodes "fine" and only the layer's diff id catches it.
        let mut e = zstd::stream::Encoder::new(Vec::new(), 3).unwrap();
        e.include_checksum(true).unwrap();
        e.write_all(data).unwrap();
        e.finish().unwrap()
    }

    fn decode(blob: &[u8], c: Compression) -> io::Result<Vec<u8>> {
        let mut out = Vec::new();
        decoder(blob, c)?.read_to_end(&mut out)?;
        Ok(out)
    }

    #[test]
    fn media_types_and_sniffing() {
        assert_eq!(
            Compression::from_media_type("application/vnd.oci.image.layer.v1.tar+gzip"),
            Some(Compression::Gzip)
        );
        assert_eq!(
            Compression::from_media_type("application/vnd.docker.image.rootfs.diff.tar.gzip"),
            Some(Compression::Gzip)
        );
        assert_eq!(
            Compression::from_media_type("application/vnd.oci.image.layer.v1.tar+zstd"),
            Some(Compression::Zstd)
        );
        assert_eq!(Compression::from_media_type("application/vnd.oci.image.layer.v1.tar"), Some(Compression::None));
        assert_eq!(Compression::from_media_type("application/vnd.oci.image.config.v1+json"), None);
        assert_eq!(Compression::sniff(&gzip(b"x")), Compression::Gzip);
        assert_eq!(Compression::sniff(&zstd(b"x")), Compression::Zstd);
        assert_eq!(Compression::sniff(b"etc/\0\0\0"), Compression::None);
        assert_eq!(Compression::sniff(b""), Compression::None);
    }

    #[test]
    fn round_trips() {
        let data = payload();
        assert_eq!(decode(&gzip(&data), Compression::Gzip).unwrap(), data);
        assert_eq!(decode(&zstd(&data), Compression::Zstd).unwrap(), data);
        assert_eq!(decode(&data, Compression::None).unwrap(), data);
        // Two gzip members are one stream.
        let mut two = gzip(&data[..1000]);
        two.extend(gzip(&data[1000..]));
        assert_eq!(decode(&two, Compression::Gzip).unwrap(), data);
    }

    #[test]
    fn truncated_streams_fail() {
        let data = payload();
        for (blob, c) in [(gzip(&data), Compression::Gzip), (zstd(&data), Compression::Zstd)] {
            for cut in [1, 8, blob.len() / 2, blob.len() - 4, blob.len() - 1] {
                let r = decode(&blob[..blob.len() - cut], c);
                assert!(r.is_err(), "{c:?} cut by {cut} bytes decoded to {} bytes", r.map(|v| v.len()).unwrap_or(0));
            }
        }
    }

    #[test]
    fn corrupt_streams_fail() {
        let data = payload();
        for (mut blob, c) in [(gzip(&data), Compression::Gzip), (zstd(&data), Compression::Zstd)] {
            let mid = blob.len() / 2;
            for b in &mut blob[mid..mid + 16] {
                *b ^= 0x5a;
            }
            assert!(decode(&blob, c).is_err(), "{c:?}");
        }
        // Not compressed at all.
        assert!(decode(b"definitely not gzip", Compression::Gzip).is_err());
        assert!(decode(b"definitely not zstd", Compression::Zstd).is_err());
    }
}

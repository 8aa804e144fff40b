//! Layer tars for the image tests, made with the tar crate.

use std::io::Write;

/// A tar of `(name, contents)` regular files (mode 0644) and `name/` directories (0755), owned
/// by 0:0 and dated 2023-11-14.
pub fn layer(files: &[(&str, &str)]) -> Vec<u8> {
    let mut b = tar::Builder::new(Vec::new());
    for (name, data) in files {
        let mut h = tar::Header::new_gnu();
        h.set_uid(0);
        h.set_gid(0);
        h.set_mtime(1_700_000_000);
        if let Some(dir) = name.strip_suffix('/') {
            h.set_entry_type(tar::EntryType::Directory);
            h.set_mode(0o755);
            h.set_size(0);
            b.append_data(&mut h, dir, &[][..]).unwrap();
        } else {
            h.set_entry_type(tar::EntryType::Regular);
            h.set_mode(0o644);
            h.set_size(data.len() as u64);
            b.append_data(&mut h, name, data.as_bytes()).unwrap();
        }
    }
    b.into_inner().unwrap()
}

/// `raw` gzip-compressed.
pub fn gzip(raw: &[u8]) -> Vec<u8> {
    let mut gz = flate2::write::GzEncoder::new(Vec::new(), flate2::Compression::fast());
    gz.write_all(raw).unwrap();
    gz.finish().unwrap()
}

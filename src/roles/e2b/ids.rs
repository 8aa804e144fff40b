//! Names as E2B's SDKs see them (docs/e2b.md "What differs"): sandbox ids, labels, list
//! filters and page tokens.

use std::collections::BTreeMap;

use base64::Engine;

/// Label holding the E2B template id a sandbox was created from.
pub const TEMPLATE_LABEL: &str = "e2b.template";
/// Prefix of the labels holding a sandbox's E2B metadata (`e2b.meta.<key>`).
pub const META_PREFIX: &str = "e2b.meta.";
/// Prefix of the labels holding the environment variables given at creation
/// (`e2b.env.<name>`), applied to every command the gateway starts.
pub const ENV_PREFIX: &str = "e2b.env.";

/// Our sandbox id (`<edge>.<suffix>`) as E2B's: the dot becomes a dash, since E2B ids go into
/// host names (`<port>-<id>.<domain>`).
pub fn to_e2b(id: &str) -> String {
    id.replace('.', "-")
}

/// An E2B sandbox id back to ours: the last dash is the dot (edge ids may hold dashes, the
/// random suffix never does). `None` for an id that cannot be one of ours.
pub fn from_e2b(id: &str) -> Option<String> {
    let (edge, suffix) = id.rsplit_once('-')?;
    let ok = |s: &str, dash: bool| {
        !s.is_empty()
            && s.len() <= 64
            && s.bytes()
                .all(|b| b.is_ascii_lowercase() || b.is_ascii_digit() || (dash && b == b'-'))
    };
    (ok(edge, true) && ok(suffix, false)).then(|| format!("{edge}.{suffix}"))
}

/// The labels carrying `prefix`, with the prefix taken off.
pub fn labelled(
    labels: &std::collections::HashMap<String, String>,
    prefix: &str,
) -> BTreeMap<String, String> {
    labels
        .iter()
        .filter_map(|(k, v)| k.strip_prefix(prefix).map(|k| (k.to_string(), v.clone())))
        .collect()
}

/// Decodes the list call's `metadata` filter, the parameter's value once the request's own
/// query decoding took off the outer layer. The SDKs percent-encode each key and value, join
/// them as a query string, and the HTTP layer encodes that once more: so this parses the
/// query string (decoding each part) and then decodes each key and value once more.
/// Errors: a message naming what is malformed.
pub fn metadata_filter(param: &str) -> Result<BTreeMap<String, String>, String> {
    let mut out = BTreeMap::new();
    let twice = |s: &str| percent_decode(s).and_then(|once| decode(&once, false));
    for pair in param.split('&').filter(|p| !p.is_empty()) {
        let (k, v) = pair.split_once('=').unwrap_or((pair, ""));
        let k = twice(k).ok_or_else(|| {
            format!(
                "metadata: bad encoding in {}",
                crate::types::names::shown(k)
            )
        })?;
        let v = twice(v).ok_or_else(|| {
            format!(
                "metadata: bad encoding in {}",
                crate::types::names::shown(v)
            )
        })?;
        out.insert(k, v);
    }
    Ok(out)
}

/// `application/x-www-form-urlencoded` decoding of one part (`+` is a space). `None` for a
/// broken escape or bytes that are not UTF-8.
pub fn percent_decode(s: &str) -> Option<String> {
    decode(s, true)
}

/// Percent-decoding, with `+` as a space when `plus` (form encoding) or kept (a URL part).
fn decode(s: &str, plus: bool) -> Option<String> {
    let b = s.as_bytes();
    let mut out = Vec::with_capacity(b.len());
    let mut i = 0;
    while let Some(&c) = b.get(i) {
        match c {
            b'%' => {
                let hex = b.get(i + 1..i + 3)?;
                let hex = std::str::from_utf8(hex).ok()?;
                out.push(u8::from_str_radix(hex, 16).ok()?);
                i += 3;
            }
            b'+' if plus => {
                out.push(b' ');
                i += 1;
            }
            c => {
                out.push(c);
                i += 1;
            }
        }
    }
    String::from_utf8(out).ok()
}

/// A list page token: where the previous page ended, as (creation time, sandbox id).
pub fn page_token(created_at: i64, id: &str) -> String {
    base64::engine::general_purpose::URL_SAFE_NO_PAD.encode(format!("{created_at}:{id}"))
}

/// Reads a page token back. Errors: a message for a token this gateway did not hand out.
pub fn parse_page_token(t: &str) -> Result<(i64, String), String> {
    let bad = || {
        format!(
            "nextToken {} is not one this API handed out",
            crate::types::names::shown(t)
        )
    };
    let raw = base64::engine::general_purpose::URL_SAFE_NO_PAD
        .decode(t)
        .map_err(|_| bad())?;
    let text = String::from_utf8(raw).map_err(|_| bad())?;
    let (at, id) = text.split_once(':').ok_or_else(bad)?;
    Ok((at.parse().map_err(|_| bad())?, id.to_string()))
}

/// A snapshot list's page token: the last name of the page before, wrapped so that no
/// name a caller types is taken for one (it would silently skip the names before it).
pub fn snapshot_page_token(last: &str) -> String {
    base64::engine::general_purpose::URL_SAFE_NO_PAD.encode(format!("snapshots:{last}"))
}

/// Reads a snapshot page token back to the name the page ended at. The name need not be a
/// snapshot still: one deleted between two pages still marks where the next one starts.
/// Errors: a message for a token this gateway did not hand out.
pub fn parse_snapshot_page_token(t: &str) -> Result<String, String> {
    let bad = || {
        format!(
            "nextToken {} is not a page token this API gave",
            crate::types::names::shown(t)
        )
    };
    let raw = base64::engine::general_purpose::URL_SAFE_NO_PAD
        .decode(t)
        .map_err(|_| bad())?;
    let text = String::from_utf8(raw).map_err(|_| bad())?;
    let name = text.strip_prefix("snapshots:").ok_or_else(bad)?;
    crate::images::name::ImageRef::parse(name).map_err(|_| bad())?;
    Ok(name.to_string())
}

/// Unix seconds as the RFC 3339 time the SDKs parse (`2026-12-05T09:00:00Z`).
pub fn rfc3339(unix_s: i64) -> String {
    chrono::DateTime::from_timestamp(unix_s, 0)
        .unwrap_or_default()
        .to_rfc3339_opts(chrono::SecondsFormat::Secs, true)
}

/// Parses an RFC 3339 time (the list call's `startedAfter`) to Unix seconds.
pub fn parse_rfc3339(s: &str) -> Option<i64> {
    chrono::DateTime::parse_from_rfc3339(s)
        .ok()
        .map(|t| t.timestamp())
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn ids_map_both_ways() {
        for id in ["edge-1.0123456789abcdef", "n1.ab", "a-b-c.x9"] {
            let e = to_e2b(id);
            assert!(!e.contains('.'));
            assert_eq!(from_e2b(&e).as_deref(), Some(id));
        }
        for bad in ["", "nodash", "-x", "x-", "A-b", "a-b.c", "a-b/c", "a b-c"] {
            assert_eq!(from_e2b(bad), None, "{bad}");
        }
    }

    #[test]
    fn the_triple_encoded_metadata_filter_decodes() {
        // `{"k": "v w", "a&b": "1=2", "odd": "x y/z%+"}` as E2B's Python SDK sends it
        // (`metadata=k%3Dv%252520w%26...`), after the request's own query decoding.
        let got = metadata_filter("k=v%2520w&a%2526b=1%253D2&odd=x%2520y%2Fz%2525%252B").unwrap();
        assert_eq!(
            got,
            BTreeMap::from([
                ("k".to_string(), "v w".to_string()),
                ("a&b".to_string(), "1=2".to_string()),
                ("odd".to_string(), "x y/z%+".to_string()),
            ])
        );
        assert!(metadata_filter("k=%zz").is_err());
        assert!(metadata_filter("k=%ff").is_err());
        assert_eq!(metadata_filter("").unwrap(), BTreeMap::new());
    }

    #[test]
    fn page_tokens_round_trip_and_strangers_are_refused() {
        let t = page_token(1_700_000_000, "n1.ab");
        assert_eq!(
            parse_page_token(&t).unwrap(),
            (1_700_000_000, "n1.ab".into())
        );
        for bad in ["", "!!", "bm9jb2xvbg", "eDp5"] {
            assert!(parse_page_token(bad).is_err(), "{bad}");
        }
    }

    #[test]
    fn snapshot_page_tokens_round_trip_and_names_are_no_tokens() {
        let t = snapshot_page_token("root/e2b/a:default");
        assert_eq!(parse_snapshot_page_token(&t).unwrap(), "root/e2b/a:default");
        let wrapped_junk = base64::engine::general_purpose::URL_SAFE_NO_PAD.encode("snapshots:<>");
        for bad in [
            "",
            "root/e2b/a:default",
            &page_token(1, "n1.ab"),
            &wrapped_junk,
        ] {
            assert!(parse_snapshot_page_token(bad).is_err(), "{bad}");
        }
    }

    #[test]
    fn times_are_rfc3339() {
        assert_eq!(rfc3339(0), "1970-01-01T00:00:00Z");
        assert_eq!(
            parse_rfc3339("2026-12-05T09:00:00+01:00"),
            Some(1_796_457_600)
        );
        assert_eq!(parse_rfc3339("yesterday"), None);
    }
}

//! Image names, `<project>/<name>:<tag>` (docs/images.md "Names"): the project an existing
//! project path, the name lower case, the tag `latest` when left out. Every error names the
//! part that is wrong.

use std::fmt;

use crate::types::names::{check_project_path, shown};
use crate::types::Failure;

/// A parsed store image name.
#[derive(Clone, Debug, PartialEq, Eq, Hash, PartialOrd, Ord)]
pub struct ImageRef {
    /// `root`, `root/rl`: the project the image belongs to (its permissions apply).
    pub project: String,
    /// `[a-z0-9][a-z0-9._-]*`, at most 128 characters.
    pub name: String,
    /// `[A-Za-z0-9_][A-Za-z0-9._-]*`, at most 128 characters; `latest` by default.
    pub tag: String,
}

const MAX_PART: usize = 128;
const MAX_SEGMENT: usize = 64;

impl ImageRef {
    /// Parses `project/name[:tag]`. Errors: `invalid`, naming the project, name or tag and
    /// the rule it breaks; a name without `/` (a node-local image such as `host`) is `invalid`
    /// here, since it has no project.
    pub fn parse(s: &str) -> Result<ImageRef, Failure> {
        let Some((project, rest)) = s.rsplit_once('/') else {
            return Err(Failure::invalid(format!(
                "image {} has no project: store images are named <project>/<name>:<tag>",
                shown(s)
            )));
        };
        let (name, tag) = match rest.split_once(':') {
            Some((n, t)) => (n, t),
            None => (rest, "latest"),
        };
        check_project_path(project)
            .map_err(|f| Failure::invalid(format!("image {}: {}", shown(s), f.message)))?;
        for seg in project.split('/') {
            let ok = seg.len() <= MAX_SEGMENT
                && seg
                    .bytes()
                    .next()
                    .is_some_and(|b| b.is_ascii_alphanumeric())
                && seg
                    .bytes()
                    .all(|b| b.is_ascii_alphanumeric() || matches!(b, b'.' | b'_' | b'-'));
            if !ok {
                return Err(Failure::invalid(format!(
                    "image {}: project segment {} must be [A-Za-z0-9][A-Za-z0-9._-]*, at most {MAX_SEGMENT} characters",
                    shown(s),
                    shown(seg)
                )));
            }
        }
        let name_ok = name.len() <= MAX_PART
            && name
                .bytes()
                .next()
                .is_some_and(|b| b.is_ascii_lowercase() || b.is_ascii_digit())
            && name.bytes().all(|b| {
                b.is_ascii_lowercase() || b.is_ascii_digit() || matches!(b, b'.' | b'_' | b'-')
            });
        if !name_ok {
            return Err(Failure::invalid(format!(
                "image {}: name {} must be [a-z0-9][a-z0-9._-]* (lower case), at most {MAX_PART} characters",
                shown(s),
                shown(name)
            )));
        }
        let tag_ok = tag.len() <= MAX_PART
            && tag
                .bytes()
                .next()
                .is_some_and(|b| b.is_ascii_alphanumeric() || b == b'_')
            && tag
                .bytes()
                .all(|b| b.is_ascii_alphanumeric() || matches!(b, b'.' | b'_' | b'-'));
        if !tag_ok {
            return Err(Failure::invalid(format!(
                "image {}: tag {} must be [A-Za-z0-9_][A-Za-z0-9._-]*, at most {MAX_PART} characters",
                shown(s),
                shown(tag)
            )));
        }
        Ok(ImageRef {
            project: project.to_string(),
            name: name.to_string(),
            tag: tag.to_string(),
        })
    }
}

impl fmt::Display for ImageRef {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        write!(f, "{}/{}:{}", self.project, self.name, self.tag)
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn good_names_and_the_default_tag() {
        let r = ImageRef::parse("root/rl/py:3.12").unwrap();
        assert_eq!(
            (r.project.as_str(), r.name.as_str(), r.tag.as_str()),
            ("root/rl", "py", "3.12")
        );
        assert_eq!(ImageRef::parse("root/swe-4821").unwrap().tag, "latest");
        assert_eq!(
            ImageRef::parse("root/a_b.c:_x-1").unwrap().to_string(),
            "root/a_b.c:_x-1"
        );
    }

    #[test]
    fn each_bad_part_is_named() {
        for (bad, part) in [
            ("host", "no project"),
            ("team/py:1", "project"),
            ("root/Py:1", "name"),
            ("root/-py", "name"),
            ("root/py:", "tag"),
            ("root/py:.x", "tag"),
            ("root/py:a:b", "tag"),
            ("root/.x/py", "project segment"),
            ("root//py", "project"),
            ("root/py/", "name"),
        ] {
            let e = ImageRef::parse(bad).unwrap_err();
            assert_eq!(e.reason, crate::types::Reason::Invalid, "{bad}");
            assert!(e.message.contains(part), "{bad}: {}", e.message);
        }
        let long = format!("root/{}", "a".repeat(129));
        assert!(ImageRef::parse(&long).unwrap_err().message.contains("name"));
    }
}

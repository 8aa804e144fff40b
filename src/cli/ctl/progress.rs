//! How `image import` shows its progress on stderr (docs/cli.md "image import"): a bar per
//! layer (bytes, rate) on a terminal, one line per layer otherwise, nothing with `-q`.

use std::cell::RefCell;
use std::io::IsTerminal;
use std::time::Instant;

use indicatif::{ProgressBar, ProgressDrawTarget, ProgressStyle};

use crate::images::import::Progress;

/// The display an import reports to.
pub enum Display {
    Quiet,
    /// A line per layer when it is done.
    Lines {
        since: RefCell<Instant>,
    },
    /// The current layer's bar; layers are read one after another.
    Bars {
        bar: RefCell<Option<ProgressBar>>,
    },
}

impl Display {
    /// Bars when stderr is a terminal, lines when it is not, nothing when `quiet`.
    pub fn new(quiet: bool) -> Display {
        if quiet {
            Display::Quiet
        } else if std::io::stderr().is_terminal() {
            Display::Bars {
                bar: RefCell::new(None),
            }
        } else {
            Display::Lines {
                since: RefCell::new(Instant::now()),
            }
        }
    }

    /// Shows one event.
    pub fn show(&self, p: Progress) {
        match self {
            Display::Quiet => {}
            Display::Lines { since } => {
                let started = *since.borrow();
                if let Some(line) = line(&p, started) {
                    eprintln!("{line}");
                    *since.borrow_mut() = Instant::now();
                }
                if matches!(p, Progress::Started { .. }) {
                    *since.borrow_mut() = Instant::now();
                }
            }
            Display::Bars { bar } => match &p {
                Progress::Started {
                    index,
                    count,
                    diff_id,
                    size,
                } => {
                    let b = match size {
                        Some(s) => {
                            ProgressBar::with_draw_target(Some(*s), ProgressDrawTarget::stderr())
                                .with_style(style(
                                "{prefix} [{bar:30}] {bytes}/{total_bytes} {bytes_per_sec} {eta}",
                            ))
                        }
                        None => ProgressBar::with_draw_target(None, ProgressDrawTarget::stderr())
                            .with_style(style("{prefix} {spinner} {bytes} {bytes_per_sec}")),
                    };
                    b.set_prefix(format!("layer {index}/{count} {}", short(diff_id)));
                    if let Some(old) = bar.replace(Some(b)) {
                        old.finish_and_clear();
                    }
                }
                Progress::Read { bytes, .. } => {
                    if let Some(b) = bar.borrow().as_ref() {
                        b.set_position(*bytes);
                    }
                }
                Progress::Imported { .. } | Progress::Cached { .. } => {
                    let since = bar
                        .borrow_mut()
                        .take()
                        .map(|b| {
                            let started = Instant::now()
                                .checked_sub(b.elapsed())
                                .unwrap_or_else(Instant::now);
                            b.finish_and_clear();
                            started
                        })
                        .unwrap_or_else(Instant::now);
                    if let Some(l) = line(&p, since) {
                        eprintln!("{l}");
                    }
                }
            },
        }
    }
}

fn style(template: &str) -> ProgressStyle {
    ProgressStyle::with_template(template)
        .unwrap_or_else(|_| ProgressStyle::default_bar())
        .progress_chars("=> ")
}

/// The line a finished layer gets (`None` for the events in between).
pub fn line(p: &Progress, since: Instant) -> Option<String> {
    match p {
        Progress::Cached {
            index,
            count,
            diff_id,
        } => Some(format!(
            "layer {index}/{count} {}: already in the store",
            short(diff_id)
        )),
        Progress::Imported {
            index,
            count,
            diff_id,
            file_bytes,
        } => {
            let secs = since.elapsed().as_secs_f64();
            Some(format!(
                "layer {index}/{count} {}: imported, {:.1} MB in {secs:.1} s",
                short(diff_id),
                *file_bytes as f64 / 1e6
            ))
        }
        Progress::Started { .. } | Progress::Read { .. } => None,
    }
}

fn short(diff_id: &str) -> &str {
    diff_id.get(..19).unwrap_or(diff_id)
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn finished_layers_get_a_line_and_the_events_between_none() {
        let now = Instant::now();
        let d = "sha256:0123456789abcdef0123".to_string();
        let l = line(
            &Progress::Imported {
                index: 2,
                count: 3,
                diff_id: d.clone(),
                file_bytes: 2_500_000,
            },
            now,
        )
        .unwrap();
        assert!(
            l.starts_with("layer 2/3 sha256:0123456789ab: imported, 2.5 MB in "),
            "{l}"
        );
        assert!(line(&Progress::Read { index: 1, bytes: 5 }, now).is_none());
        assert_eq!(
            line(
                &Progress::Cached {
                    index: 1,
                    count: 3,
                    diff_id: d
                },
                now
            )
            .unwrap(),
            "layer 1/3 sha256:0123456789ab: already in the store"
        );
    }

    #[test]
    fn every_display_takes_a_whole_import() {
        let d = "sha256:0123456789abcdef0123".to_string();
        let events = [
            Progress::Started {
                index: 1,
                count: 2,
                diff_id: d.clone(),
                size: Some(10),
            },
            Progress::Read {
                index: 1,
                bytes: 10,
            },
            Progress::Imported {
                index: 1,
                count: 2,
                diff_id: d.clone(),
                file_bytes: 10,
            },
            Progress::Cached {
                index: 2,
                count: 2,
                diff_id: d,
            },
        ];
        let displays = [
            Display::Quiet,
            Display::Lines {
                since: RefCell::new(Instant::now()),
            },
            Display::Bars {
                bar: RefCell::new(None),
            },
        ];
        for display in &displays {
            for e in &events {
                display.show(e.clone());
            }
        }
        if let Display::Bars { bar } = &displays[2] {
            assert!(bar.borrow().is_none(), "the last bar is finished");
        }
    }
}

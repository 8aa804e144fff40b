use std::fs;
use std::os::unix::fs::PermissionsExt;
use std::path::Path;
use std::pin::Pin;
use std::time::Duration;

use futures::{Stream, StreamExt};

use super::registry::{Watchers, MAX_WATCHES};
use super::*;

type Events = Pin<Box<dyn Stream<Item = Result<crate::pb::FileEvent, Failure>> + Send>>;

fn opts(recursive: bool) -> Options {
    Options {
        recursive,
        ..Options::default()
    }
}

/// A stream watch on `root`, its `start` event read.
async fn watch_with(ws: &Watchers, root: &Path, o: Options) -> Events {
    let mut s: Events = Box::pin(ws.stream(root.to_path_buf(), o).await.expect("watch"));
    let first = s.next().await.expect("start").expect("start");
    assert_eq!((first.name.as_str(), first.r#type.as_str()), ("", "start"));
    s
}

async fn watch(root: &Path, o: Options) -> Events {
    watch_with(&Watchers::new(), root, o).await
}

/// The next item within 5 s; `None` at the end.
async fn next_item(w: &mut Events) -> Option<Result<crate::pb::FileEvent, Failure>> {
    tokio::time::timeout(Duration::from_secs(5), w.next())
        .await
        .expect("an event within 5 s")
}

async fn next(w: &mut Events) -> Option<crate::pb::FileEvent> {
    next_item(w).await.map(|r| r.expect("event"))
}

/// The events that come within a quiet 300 ms, as (name, type).
async fn drain(w: &mut Events) -> Vec<(String, String)> {
    let mut out = Vec::new();
    while let Ok(r) = tokio::time::timeout(Duration::from_millis(300), w.next()).await {
        match r {
            Some(e) => {
                let e = e.expect("event");
                out.push((e.name, e.r#type))
            }
            None => break,
        }
    }
    out
}

fn pairs(v: &[(&str, &str)]) -> Vec<(String, String)> {
    v.iter()
        .map(|(a, b)| (a.to_string(), b.to_string()))
        .collect()
}

#[tokio::test]
async fn a_files_life_is_seen_in_envds_words() {
    let d = tempfile::tempdir().expect("tmp");
    let mut w = watch(d.path(), opts(false)).await;
    let f = d.path().join("f.txt");
    fs::write(&f, "hello").expect("write");
    fs::set_permissions(&f, fs::Permissions::from_mode(0o600)).expect("chmod");
    fs::rename(&f, d.path().join("g.txt")).expect("rename");
    fs::remove_file(d.path().join("g.txt")).expect("rm");
    assert_eq!(
        drain(&mut w).await,
        pairs(&[
            ("f.txt", "create"),
            ("f.txt", "write"),
            ("f.txt", "chmod"),
            ("f.txt", "rename"),
            ("g.txt", "create"),
            ("g.txt", "remove"),
        ])
    );
}

#[tokio::test]
async fn only_a_recursive_watch_sees_below_and_new_directories_are_followed() {
    let d = tempfile::tempdir().expect("tmp");
    fs::create_dir(d.path().join("old")).expect("mkdir");
    let mut flat = watch(d.path(), opts(false)).await;
    let mut deep = watch(d.path(), opts(true)).await;
    fs::write(d.path().join("old/a"), "1").expect("write");
    fs::create_dir(d.path().join("new")).expect("mkdir");
    // Made before the watch on `new` can be in place: reported as made all the same.
    fs::create_dir_all(d.path().join("new/x/y")).expect("mkdir -p");
    fs::write(d.path().join("new/x/y/b"), "2").expect("write");
    let got = drain(&mut deep).await;
    for want in [
        ("old/a", "create"),
        ("old/a", "write"),
        ("new", "create"),
        ("new/x", "create"),
        ("new/x/y", "create"),
        ("new/x/y/b", "create"),
    ] {
        assert!(
            got.contains(&(want.0.to_string(), want.1.to_string())),
            "{want:?} missing from {got:?}"
        );
    }
    // Later writes deep down are seen by their own watch.
    fs::write(d.path().join("new/x/y/b"), "3").expect("write");
    assert!(drain(&mut deep)
        .await
        .contains(&("new/x/y/b".to_string(), "write".to_string())));
    assert_eq!(drain(&mut flat).await, pairs(&[("new", "create")]));
}

#[tokio::test]
async fn a_renamed_directory_reports_under_its_new_name_and_one_moved_out_is_dropped() {
    let d = tempfile::tempdir().expect("tmp");
    let out = tempfile::tempdir().expect("tmp");
    fs::create_dir_all(d.path().join("a/deep")).expect("mkdir");
    fs::create_dir(d.path().join("gone")).expect("mkdir");
    let mut w = watch(d.path(), opts(true)).await;
    fs::rename(d.path().join("a"), d.path().join("b")).expect("rename");
    fs::rename(d.path().join("gone"), out.path().join("gone")).expect("move out");
    assert_eq!(
        drain(&mut w).await,
        pairs(&[("a", "rename"), ("b", "create"), ("gone", "rename")])
    );
    fs::write(d.path().join("b/deep/f"), "x").expect("write");
    fs::write(out.path().join("gone/f"), "x").expect("write outside");
    assert_eq!(
        drain(&mut w).await,
        pairs(&[("b/deep/f", "create"), ("b/deep/f", "write")])
    );
}

#[tokio::test]
async fn the_watch_ends_when_its_directory_is_removed() {
    let top = tempfile::tempdir().expect("tmp");
    let d = top.path().join("w");
    fs::create_dir(&d).expect("mkdir");
    let mut w = watch(&d, opts(true)).await;
    fs::remove_dir(&d).expect("rmdir");
    let mut got = Vec::new();
    while let Some(e) = next(&mut w).await {
        got.push((e.name, e.r#type));
    }
    assert_eq!(got, pairs(&[(".", "remove")]));
}

#[tokio::test]
async fn entries_come_with_their_info_while_they_exist() {
    let d = tempfile::tempdir().expect("tmp");
    let o = Options {
        include_entry: true,
        ..Options::default()
    };
    let mut w = watch(d.path(), o).await;
    fs::create_dir(d.path().join("sub")).expect("mkdir");
    let e = next(&mut w).await.expect("one");
    let info = e.entry.expect("entry");
    assert_eq!((e.name.as_str(), e.r#type.as_str()), ("sub", "create"));
    assert_eq!(info.r#type, "dir");
    assert_eq!(info.path, d.path().join("sub").to_string_lossy());
    fs::remove_dir(d.path().join("sub")).expect("rmdir");
    let e = next(&mut w).await.expect("one");
    assert_eq!((e.name.as_str(), e.r#type.as_str()), ("sub", "remove"));
    assert!(e.entry.is_none());
}

#[tokio::test]
async fn what_cannot_be_watched_is_refused_with_its_reason() {
    let d = tempfile::tempdir().expect("tmp");
    let f = d.path().join("file");
    fs::write(&f, "x").expect("write");
    let ws = Watchers::new();
    for (p, want) in [
        (d.path().join("none"), Reason::NotFound),
        (f.clone(), Reason::Invalid),
    ] {
        let r = ws.stream(p.clone(), opts(false)).await;
        assert_eq!(
            r.map(|_| ()).expect_err("refused").reason,
            want,
            "{}",
            p.display()
        );
        let r = ws.create(p.clone(), opts(true)).await;
        assert_eq!(
            r.map(|_| ()).expect_err("refused").reason,
            want,
            "{}",
            p.display()
        );
    }
    // A symlink to a directory is followed, as envd follows it.
    std::os::unix::fs::symlink(d.path(), d.path().join("link")).expect("symlink");
    let _w = watch_with(&ws, &d.path().join("link"), opts(false)).await;
    // Refusals hold no place and no mark: one watch, one mark.
    assert_eq!(ws.marks(), 1);
}

#[tokio::test]
async fn watches_share_marks_and_give_them_back() {
    let d = tempfile::tempdir().expect("tmp");
    for i in 0..5 {
        fs::create_dir_all(d.path().join(format!("d{i}/e"))).expect("mkdir");
    }
    // A symlinked directory is not entered.
    std::os::unix::fs::symlink("/usr", d.path().join("usr")).expect("symlink");
    let ws = Watchers::new();
    // The root, the five and the five below them.
    let mut deep = watch_with(&ws, d.path(), opts(true)).await;
    assert_eq!(ws.marks(), 11);
    // A second watch on part of the tree adds no mark, and names events from its root.
    let mut part = watch_with(&ws, &d.path().join("d0"), opts(true)).await;
    assert_eq!(ws.marks(), 11);
    fs::write(d.path().join("d0/e/f"), "").expect("touch");
    assert_eq!(drain(&mut part).await, pairs(&[("e/f", "create")]));
    assert_eq!(drain(&mut deep).await, pairs(&[("d0/e/f", "create")]));
    drop(deep);
    assert_eq!(ws.marks(), 2, "d0 and d0/e stay for the second watch");
    drop(part);
    assert_eq!(ws.marks(), 0);
}

#[tokio::test]
async fn a_tree_past_the_most_directories_is_refused_and_leaves_no_mark() {
    let d = tempfile::tempdir().expect("tmp");
    for i in 0..MAX_DIRS {
        fs::create_dir(d.path().join(format!("{i}"))).expect("mkdir");
    }
    let ws = Watchers::new();
    let r = ws.stream(d.path().to_path_buf(), opts(true)).await;
    assert_eq!(
        r.map(|_| ()).expect_err("refused").reason,
        Reason::QuotaExceeded
    );
    assert_eq!(ws.marks(), 0);
    // Without the directories below, it is one mark.
    let _flat = watch_with(&ws, d.path(), opts(false)).await;
    assert_eq!(ws.marks(), 1);
}

#[tokio::test]
async fn a_reader_that_falls_behind_loses_its_watch_not_the_others() {
    let d = tempfile::tempdir().expect("tmp");
    let ws = Watchers::new();
    let mut slow = watch_with(&ws, d.path(), opts(false)).await;
    let kept = ws
        .create(d.path().to_path_buf(), opts(false))
        .await
        .expect("create");
    let n = hub::STREAM_QUEUE + 100;
    let mut taken = 0;
    let end = std::time::Instant::now() + Duration::from_secs(20);
    for i in 0..n {
        fs::write(d.path().join(format!("f{i}")), "").expect("touch");
        // Let the hub read now and then, so the kernel's own queue never fills, and take
        // the kept watcher's events as a reader that keeps up does.
        if i % 500 == 0 {
            tokio::time::sleep(Duration::from_millis(5)).await;
            let got = ws.take(&kept).expect("take");
            assert_eq!(got.dropped, 0);
            taken += got.events.len();
        }
    }
    while taken < n && std::time::Instant::now() < end {
        taken += ws.take(&kept).expect("take").events.len();
        tokio::time::sleep(Duration::from_millis(20)).await;
    }
    assert_eq!(taken, n, "the kept watcher has every event");
    let mut got = 0;
    let failure = loop {
        match next_item(&mut slow).await {
            Some(Ok(_)) => got += 1,
            Some(Err(f)) => break f,
            None => panic!("the stream ended without saying events were lost"),
        }
    };
    assert_eq!(failure.reason, Reason::Unavailable, "{failure}");
    // Its queue's bound, in events or in bytes, whichever came first.
    assert!(got > 1000 && got <= hub::STREAM_QUEUE, "{got}");
    assert!(next_item(&mut slow).await.is_none());
}

#[tokio::test]
async fn kept_watchers_hold_their_events_until_taken_and_are_counted() {
    let d = tempfile::tempdir().expect("tmp");
    let ws = Watchers::new();
    let id = ws
        .create(d.path().to_path_buf(), opts(false))
        .await
        .expect("create");
    fs::write(d.path().join("a"), "").expect("touch");
    let mut got = Vec::new();
    for _ in 0..50 {
        got.extend(ws.take(&id).expect("take").events);
        if !got.is_empty() {
            break;
        }
        tokio::time::sleep(Duration::from_millis(20)).await;
    }
    let names: Vec<_> = got
        .iter()
        .map(|e| (e.name.as_str(), e.r#type.as_str()))
        .collect();
    assert_eq!(names, [("a", "create")]);
    assert!(ws.take(&id).expect("take").events.is_empty(), "taken once");

    // The sandbox's limit counts streams and kept watchers alike.
    let mut held = Vec::new();
    for _ in 1..MAX_WATCHES {
        held.push(
            ws.stream(d.path().to_path_buf(), opts(false))
                .await
                .expect("stream"),
        );
    }
    let refused = ws.create(d.path().to_path_buf(), opts(false)).await;
    assert_eq!(
        refused.map(|_| ()).expect_err("full").reason,
        Reason::QuotaExceeded
    );
    drop(held.pop());
    let second = ws
        .create(d.path().to_path_buf(), opts(false))
        .await
        .expect("a place was given back");
    ws.remove(&second).expect("remove");
    ws.remove(&id).expect("remove");
    assert_eq!(
        ws.take(&id).map(|_| ()).expect_err("gone").reason,
        Reason::NotFound
    );
    assert_eq!(
        ws.remove("nope").map(|_| ()).expect_err("gone").reason,
        Reason::NotFound
    );
}

#[tokio::test]
async fn a_stream_says_start_before_the_changes_and_ends_with_its_directory() {
    use futures::StreamExt;
    let top = tempfile::tempdir().expect("tmp");
    let d = top.path().join("w");
    fs::create_dir(&d).expect("mkdir");
    let ws = Watchers::new();
    let s = ws.stream(d.clone(), opts(false)).await.expect("stream");
    fs::write(d.join("f"), "").expect("touch");
    fs::remove_file(d.join("f")).expect("rm");
    fs::remove_dir(&d).expect("rmdir");
    let got: Vec<_> = tokio::time::timeout(Duration::from_secs(5), s.collect::<Vec<_>>())
        .await
        .expect("the stream ended")
        .into_iter()
        .map(|r| {
            let e = r.expect("event");
            (e.name, e.r#type)
        })
        .collect();
    assert_eq!(
        got,
        pairs(&[
            ("", "start"),
            ("f", "create"),
            ("f", "remove"),
            (".", "remove")
        ])
    );
}

#[tokio::test]
async fn a_kept_watcher_unread_holds_a_bounded_number_of_bytes() {
    let d = tempfile::tempdir().expect("tmp");
    let ws = Watchers::new();
    let kept = ws
        .create(d.path().to_path_buf(), opts(false))
        .await
        .expect("create");
    // Long names: the bytes bound comes long before the events' count.
    let long = "n".repeat(200);
    for i in 0..3000 {
        fs::write(d.path().join(format!("{long}{i}")), "").expect("touch");
        if i % 500 == 0 {
            tokio::time::sleep(Duration::from_millis(5)).await;
        }
    }
    tokio::time::sleep(Duration::from_millis(300)).await;
    let got = ws.take(&kept).expect("take");
    let bytes: usize = got.events.iter().map(hub::cost).sum();
    assert!(bytes <= hub::MAX_HELD_BYTES, "{bytes}");
    assert_eq!(got.events.len() as i64 + got.dropped, 3000);
    assert!(got.dropped > 0);
}

#[tokio::test]
async fn a_deep_mkdir_is_reported_once_per_directory() {
    let d = tempfile::tempdir().expect("tmp");
    let mut w = watch(d.path(), opts(true)).await;
    let mut deep = d.path().to_path_buf();
    let mut want = Vec::new();
    let mut rel = PathBuf::new();
    for _ in 0..120 {
        deep.push("n");
        rel.push("n");
        want.push((rel.to_string_lossy().into_owned(), "create".to_string()));
    }
    fs::create_dir_all(&deep).expect("mkdir -p");
    fs::write(deep.join("f"), "").expect("touch");
    rel.push("f");
    want.push((rel.to_string_lossy().into_owned(), "create".to_string()));
    let mut got = drain(&mut w).await;
    got.sort();
    want.sort();
    assert_eq!(got, want);
}

#[tokio::test]
async fn a_user_watches_only_what_they_may_list() {
    let d = tempfile::tempdir().expect("tmp");
    let open = d.path().join("open");
    let closed = d.path().join("open/closed");
    fs::create_dir_all(&closed).expect("mkdir");
    fs::set_permissions(&open, fs::Permissions::from_mode(0o755)).expect("chmod");
    fs::set_permissions(&closed, fs::Permissions::from_mode(0o700)).expect("chmod");
    let me = std::fs::metadata(&open).expect("stat");
    use std::os::unix::fs::MetadataExt;
    // Someone who owns neither directory and is in neither's group.
    let other = Arc::new(Access {
        uid: me.uid() + 4242,
        gid: me.gid() + 4242,
        groups: vec![],
    });
    let as_other = |recursive| Options {
        recursive,
        access: Some(other.clone()),
        ..Options::default()
    };
    let ws = Watchers::new();
    let r = ws.stream(closed.clone(), as_other(false)).await;
    assert_eq!(
        r.map(|_| ()).expect_err("refused").reason,
        Reason::Forbidden
    );
    // Recursive from above: the closed directory's name shows, what happens in it does not.
    let mut w = watch_with(&ws, &open, as_other(true)).await;
    assert_eq!(ws.marks(), 1, "no mark on the closed directory");
    fs::write(closed.join("secret"), "").expect("touch");
    fs::create_dir(open.join("new-closed")).expect("mkdir");
    fs::set_permissions(open.join("new-closed"), fs::Permissions::from_mode(0o700)).expect("chmod");
    fs::write(open.join("new-closed/secret"), "").expect("touch");
    let got = drain(&mut w).await;
    assert!(got.iter().all(|(n, _)| !n.contains("secret")), "{got:?}");
    // Its group's members may.
    let member = Options {
        access: Some(Arc::new(Access {
            uid: me.uid() + 4242,
            gid: 0,
            groups: vec![me.gid()],
        })),
        ..Options::default()
    };
    fs::set_permissions(&closed, fs::Permissions::from_mode(0o750)).expect("chmod");
    let _ok = watch_with(&ws, &closed, member).await;
}

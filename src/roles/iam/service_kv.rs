//! The lock and key-value RPCs (docs/iam-replicas.md "Locks and the key-value area"): reads
//! are linearizable (after a read index on a replica); writes are proposed and answered on
//! commit. The rules themselves are in `apply_kv`.

use super::apply_kv;
use super::command::{Command, Outcome};
use super::service::{unexpected, IamService};
use crate::pb;
use crate::types::Failure;

/// Most entries one `KvList` answers with.
const LIST_MAX: usize = 1000;
/// Bytes of keys and values after which a `KvList` page ends (clients' default message
/// limit is 4 MiB).
const PAGE_BYTES: usize = 2 << 20;

fn now_ms() -> i64 {
    (crate::types::now_f() * 1000.0) as i64
}

/// Over mTLS a holder is the caller itself (`role/id`, or `role/id#tag` so that two
/// processes of one instance tell their holds apart), and a component takes only its own
/// role's locks (names `<role>-...`, such as `watcher-reconcile`), so one component can
/// neither take nor free a lock in another's name, nor hold another role's lock to stop it.
/// `forbidden` otherwise.
fn check_caller(
    name: &str,
    holder: &str,
    caller: Option<&crate::pki::Identity>,
) -> Result<(), Failure> {
    let Some(who) = caller else {
        return Ok(());
    };
    let me = format!("{}/{}", who.role, who.id);
    let mine = holder
        .strip_prefix(me.as_str())
        .is_some_and(|rest| rest.is_empty() || rest.starts_with('#'));
    if !mine {
        return Err(Failure::forbidden(format!(
            "{}/{} may not hold a lock as {holder:?}",
            who.role, who.id
        )));
    }
    if !name.starts_with(&format!("{}-", who.role)) {
        return Err(Failure::forbidden(format!(
            "{}/{} may take only locks named {}-...",
            who.role, who.id, who.role
        )));
    }
    Ok(())
}

impl IamService {
    #[tracing::instrument(name = "iam.lock", skip_all, fields(name = %r.name, holder = %r.holder))]
    pub(super) async fn rpc_lock(
        &self,
        r: pb::LockRequest,
        caller: Option<&crate::pki::Identity>,
    ) -> Result<pb::LockResponse, Failure> {
        apply_kv::check_lock_name(&r.name)?;
        apply_kv::check_holder(&r.holder)?;
        check_caller(&r.name, &r.holder, caller)?;
        self.store().fresh().await?;
        let now_ms = now_ms();
        // A request that would be refused takes no log entry: the holders' rivals ask
        // every few seconds.
        apply_kv::check_lock(&self.store().read(), &r.name, &r.holder, now_ms)?;
        match self
            .store()
            .propose(Command::Lock {
                name: r.name,
                holder: r.holder,
                ttl_ms: r.ttl_ms,
                now_ms,
            })
            .await?
        {
            Outcome::Locked {
                fence,
                expires_at_ms,
            } => Ok(pb::LockResponse {
                expires_at_ms,
                fence,
            }),
            o => Err(unexpected(o)),
        }
    }

    #[tracing::instrument(name = "iam.unlock", skip_all, fields(name = %r.name, holder = %r.holder))]
    pub(super) async fn rpc_unlock(
        &self,
        r: pb::UnlockRequest,
        caller: Option<&crate::pki::Identity>,
    ) -> Result<pb::Empty, Failure> {
        apply_kv::check_lock_name(&r.name)?;
        apply_kv::check_holder(&r.holder)?;
        check_caller(&r.name, &r.holder, caller)?;
        match self
            .store()
            .propose(Command::Unlock {
                name: r.name,
                holder: r.holder,
            })
            .await?
        {
            Outcome::Done => Ok(pb::Empty {}),
            o => Err(unexpected(o)),
        }
    }

    pub(super) async fn rpc_kv_get(&self, r: pb::KvGetRequest) -> Result<pb::KvEntry, Failure> {
        apply_kv::check_key(&r.key)?;
        self.store().fresh().await?;
        let st = self.store().read();
        st.kv
            .get(&r.key)
            .map(|v| pb::KvEntry {
                key: r.key.clone(),
                value: v.value.clone(),
                revision: v.revision,
            })
            .ok_or_else(|| Failure::not_found(format!("key {} not found", r.key)))
    }

    pub(super) async fn rpc_kv_list(
        &self,
        r: pb::KvListRequest,
    ) -> Result<pb::KvListResponse, Failure> {
        apply_kv::check_prefix(&r.prefix)?;
        let limit = match r.limit as usize {
            0 => LIST_MAX,
            n => n.min(LIST_MAX),
        };
        self.store().fresh().await?;
        let st = self.store().read();
        let from = if r.start_after.is_empty() {
            std::ops::Bound::Included(r.prefix.clone())
        } else {
            std::ops::Bound::Excluded(r.start_after.clone())
        };
        let matching = st
            .kv
            .range((from, std::ops::Bound::Unbounded))
            .skip_while(|(k, _)| k.as_str() < r.prefix.as_str())
            .take_while(|(k, _)| k.starts_with(&r.prefix));
        let mut entries: Vec<pb::KvEntry> = Vec::new();
        let mut bytes = 0;
        let mut more = false;
        for (k, v) in matching {
            let size = k.len() + v.value.len();
            if entries.len() >= limit || (bytes > 0 && bytes + size > PAGE_BYTES) {
                more = true;
                break;
            }
            bytes += size;
            entries.push(pb::KvEntry {
                key: k.clone(),
                value: v.value.clone(),
                revision: v.revision,
            });
        }
        Ok(pb::KvListResponse {
            entries,
            revision: st.revision,
            more,
        })
    }

    #[tracing::instrument(name = "iam.kv_put", skip_all, fields(key = %r.key))]
    pub(super) async fn rpc_kv_put(
        &self,
        r: pb::KvPutRequest,
    ) -> Result<pb::KvPutResponse, Failure> {
        // Checked before proposing too: an oversized value must not reach the log.
        apply_kv::check_put(&r.key, &r.value)?;
        let cmd = Command::KvPut {
            key: r.key,
            value: r.value,
            if_revision: r.if_revision,
        };
        self.revision_of(cmd).await
    }

    #[tracing::instrument(name = "iam.kv_delete", skip_all, fields(key = %r.key))]
    pub(super) async fn rpc_kv_delete(
        &self,
        r: pb::KvDeleteRequest,
    ) -> Result<pb::KvPutResponse, Failure> {
        apply_kv::check_key(&r.key)?;
        let cmd = Command::KvDelete {
            key: r.key,
            if_revision: r.if_revision,
        };
        self.revision_of(cmd).await
    }

    async fn revision_of(&self, cmd: Command) -> Result<pb::KvPutResponse, Failure> {
        match self.store().propose(cmd).await? {
            Outcome::Revision(revision) => Ok(pb::KvPutResponse { revision }),
            o => Err(unexpected(o)),
        }
    }
}

#[cfg(test)]
mod tests {
    use super::super::{Store, StoreOptions};
    use super::*;
    use crate::pki::{Identity, Role};
    use crate::types::Reason;

    fn list(prefix: &str, start_after: &str, limit: u32) -> pb::KvListRequest {
        pb::KvListRequest {
            prefix: prefix.into(),
            start_after: start_after.into(),
            limit,
        }
    }

    fn keys(r: &pb::KvListResponse) -> Vec<&str> {
        r.entries.iter().map(|e| e.key.as_str()).collect()
    }

    #[tokio::test]
    async fn keys_are_listed_by_prefix_in_pages_and_locks_held_only_in_the_callers_name() {
        let svc = IamService::new(
            Store::open(None, StoreOptions::default()).unwrap(),
            "",
            None,
        );
        let all = ["nodes/a", "nodes/b", "nodes/c", "releases/r1", "rollouts/x"];
        for k in all {
            let put = pb::KvPutRequest {
                key: k.into(),
                value: k.as_bytes().to_vec(),
                if_revision: None,
            };
            svc.rpc_kv_put(put).await.unwrap();
        }
        let page = svc.rpc_kv_list(list("nodes/", "", 2)).await.unwrap();
        assert_eq!(
            (keys(&page), page.more, page.revision),
            (vec!["nodes/a", "nodes/b"], true, 5)
        );
        let page = svc.rpc_kv_list(list("nodes/", "nodes/b", 2)).await.unwrap();
        assert_eq!((keys(&page), page.more), (vec!["nodes/c"], false));
        let page = svc.rpc_kv_list(list("", "", 0)).await.unwrap();
        assert_eq!((keys(&page), page.more), (all.to_vec(), false));
        let page = svc.rpc_kv_list(list("releases/r", "", 0)).await.unwrap();
        assert_eq!(keys(&page), ["releases/r1"]);
        let f = svc.rpc_kv_list(list("nope/", "", 0)).await.unwrap_err();
        assert_eq!(f.reason, Reason::Invalid);
        let got = svc
            .rpc_kv_get(pb::KvGetRequest {
                key: "nodes/b".into(),
            })
            .await
            .unwrap();
        assert_eq!((got.value.as_slice(), got.revision), (&b"nodes/b"[..], 2));
        let f = svc
            .rpc_kv_get(pb::KvGetRequest {
                key: "nodes/zz".into(),
            })
            .await
            .unwrap_err();
        assert_eq!(f.reason, Reason::NotFound);

        let lock = |holder: &str| pb::LockRequest {
            name: "watcher-reconcile".into(),
            holder: holder.into(),
            ttl_ms: 5_000,
        };
        let w1 = Identity::new(Role::Watcher, "1").unwrap();
        for other in ["watcher/2", "watcher/10", "watcher/1x", "watcher/1/x"] {
            let f = svc.rpc_lock(lock(other), Some(&w1)).await.unwrap_err();
            assert_eq!(f.reason, Reason::Forbidden, "{other}: {f}");
        }
        let mut foreign = lock("watcher/1");
        foreign.name = "fleet-controller".into();
        let f = svc.rpc_lock(foreign, Some(&w1)).await.unwrap_err();
        assert_eq!(f.reason, Reason::Forbidden, "{f}");
        // Another process of watcher 1 (its own tag) is told apart from this one.
        let tagged = svc.rpc_lock(lock("watcher/1#a"), Some(&w1)).await.unwrap();
        assert_eq!(tagged.fence, 6);
        let f = svc
            .rpc_lock(lock("watcher/1"), Some(&w1))
            .await
            .unwrap_err();
        assert_eq!(f.reason, Reason::Conflict, "{f}");
        let untag = pb::UnlockRequest {
            name: "watcher-reconcile".into(),
            holder: "watcher/1#a".into(),
        };
        svc.rpc_unlock(untag, Some(&w1)).await.unwrap();
        let held = svc.rpc_lock(lock("watcher/1"), Some(&w1)).await.unwrap();
        assert_eq!(held.fence, 7);
        // A refused request takes no revision (and no log entry).
        let f = svc.rpc_lock(lock("watcher/2"), None).await.unwrap_err();
        assert_eq!(f.reason, Reason::Conflict, "{f}");
        let unlock = |holder: &str| pb::UnlockRequest {
            name: "watcher-reconcile".into(),
            holder: holder.into(),
        };
        let f = svc
            .rpc_unlock(unlock("watcher/2"), Some(&w1))
            .await
            .unwrap_err();
        assert_eq!(f.reason, Reason::Forbidden, "{f}");
        svc.rpc_unlock(unlock("watcher/1"), Some(&w1))
            .await
            .unwrap();
        let next = svc.rpc_lock(lock("watcher/2"), None).await.unwrap();
        assert_eq!(next.fence, 8);
    }
}

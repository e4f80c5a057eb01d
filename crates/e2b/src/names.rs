//! User and group names of a sandbox (envd reports owners by name; the agent by id), read
//! from its `/etc/passwd` and `/etc/group` and kept a minute. Only consulted after the
//! caller's own call into the sandbox succeeded, so it tells nobody anything their token
//! could not read.

use std::collections::HashMap;
use std::sync::{Arc, Mutex};
use std::time::{Duration, Instant};

use futures::StreamExt;
use opendsec_client::Client;
use opendsec_proto::v1 as pb;

const TTL: Duration = Duration::from_secs(60);
const MAX_SANDBOXES: usize = 1024;
/// Names kept per sandbox (of users and of groups each; the rest show as numbers).
const MAX_NAMES: usize = 4096;
/// Larger files are not read (a sandbox's own passwd file is the sandbox's to make huge).
const MAX_FILE: u64 = 1 << 20;

#[derive(Debug, Default)]
pub struct Names {
    users: HashMap<u32, String>,
    groups: HashMap<u32, String>,
}

impl Names {
    pub fn user(&self, uid: u32) -> String {
        self.users.get(&uid).cloned().unwrap_or_else(|| uid.to_string())
    }
    pub fn group(&self, gid: u32) -> String {
        self.groups.get(&gid).cloned().unwrap_or_else(|| gid.to_string())
    }
}

#[derive(Debug, Default)]
pub struct Cache {
    inner: Mutex<HashMap<String, (Instant, Arc<Names>)>>,
}

/// `name:x:id:...` lines: id -> name (the first name of an id wins).
pub fn parse_ids(text: &str) -> HashMap<u32, String> {
    let mut out = HashMap::new();
    for line in text.lines() {
        let mut f = line.split(':');
        let (Some(name), Some(_), Some(id)) = (f.next(), f.next(), f.next()) else { continue };
        if out.len() >= MAX_NAMES {
            break;
        }
        if let Ok(id) = id.trim().parse::<u32>() {
            out.entry(id).or_insert_with(|| name.to_string());
        }
    }
    out
}

impl Cache {
    pub async fn get(&self, client: &Client, sandbox: &str, session: &str) -> Arc<Names> {
        {
            let g = self.inner.lock().unwrap_or_else(|p| p.into_inner());
            if let Some((at, n)) = g.get(sandbox)
                && at.elapsed() < TTL
            {
                return n.clone();
            }
        }
        let (p, g) =
            tokio::join!(read(client, sandbox, session, "/etc/passwd"), read(client, sandbox, session, "/etc/group"));
        let names = Arc::new(Names { users: parse_ids(&p), groups: parse_ids(&g) });
        let mut g = self.inner.lock().unwrap_or_else(|p| p.into_inner());
        if g.len() >= MAX_SANDBOXES {
            g.retain(|_, (at, _)| at.elapsed() < TTL);
            if g.len() >= MAX_SANDBOXES {
                g.clear();
            }
        }
        g.insert(sandbox.to_string(), (Instant::now(), names.clone()));
        names
    }
}

async fn read(client: &Client, sandbox: &str, session: &str, path: &str) -> String {
    let req = pb::ReadFileRequest {
        sandbox_id: sandbox.into(),
        session_id: session.into(),
        path: path.into(),
        length: MAX_FILE,
        ..Default::default()
    };
    let Ok(mut s) = client.read_file(req).await else { return String::new() };
    let mut out = Vec::new();
    while let Some(Ok(c)) = s.next().await {
        out.extend_from_slice(&c.data);
        if out.len() as u64 > MAX_FILE {
            out.truncate(MAX_FILE as usize);
            break;
        }
    }
    String::from_utf8_lossy(&out).into_owned()
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn ids_map_to_their_first_name() {
        let m =
            parse_ids("root:x:0:0:root:/root:/bin/bash\nuser:x:1000:1000::/home/user:/bin/bash\nbad\nalias:x:0:0\n");
        assert_eq!(m[&0], "root");
        assert_eq!(m[&1000], "user");
        assert_eq!(m.len(), 2);
    }
}

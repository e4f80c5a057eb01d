//! Reading sandboxes: one, or a page of a filtered listing.

use super::*;

impl Inner {
    pub(crate) fn get(&self, id: &str) -> Result<Sandbox, EdgeError> {
        let lease = self.lease_of(id)?;
        let rec = self.table().rec(lease).ok_or_else(|| self.not_found(id))?;
        // A sandbox that moved away answers where it went; one moving away answers as it is.
        if !rec.moved.moved_to.is_empty() {
            Self::check_not_moving(&rec)?;
        }
        Ok(self.to_proto(&rec))
    }

    pub(crate) fn list(&self, req: &EdgeListRequest) -> Result<EdgeListResponse, EdgeError> {
        if !req.project.is_empty() {
            ids::validate_project(&req.project).map_err(|e| EdgeError::InvalidArgument(e.message))?;
        }
        let states = req
            .states
            .iter()
            .map(|s| {
                SandboxState::try_from(*s)
                    .ok()
                    .and_then(SandboxStatus::from_proto)
                    .ok_or_else(|| EdgeError::InvalidArgument(format!("states: {s} is not a sandbox state")))
            })
            .collect::<Result<Vec<_>, _>>()?;
        let filter = ListFilter { project: req.project.clone(), states, labels: req.labels.clone() };
        let limit = match req.limit as usize {
            0 => LIST_DEFAULT,
            n => n.min(LIST_MAX),
        };
        let found = self.table().list(&self.name, &filter, &req.after, limit);
        Ok(EdgeListResponse {
            sandboxes: found.recs.iter().map(|r| self.to_proto(r)).collect(),
            more: found.more,
            moved_away: found.away.into_iter().map(|(id, to)| MovedAway { id, to }).collect(),
            moved_away_upto: found.away_upto.unwrap_or_default(),
        })
    }
}

// A real OpenID provider (panva's oidc-provider) for the dashboard's login tests, on 127.0.0.1 only.
//
//   node provider.mjs CONFIG.json
//
// CONFIG.json: {"port": P, "client_id": ..., "client_secret": ..., "redirect_uri": ...,
//               "users": {"login": {"password": ..., "email": ...}}}
// Signs ID tokens with an RSA key made at start (RS256). Its own login and consent pages are the library's
// (devInteractions); a login is accepted only with the user's password. Prints "listening ISSUER" once ready.
import { generateKeyPairSync, randomBytes } from 'node:crypto';
import { readFileSync } from 'node:fs';
import { createServer } from 'node:http';

import Provider from 'oidc-provider';

const config = JSON.parse(readFileSync(process.argv[2], 'utf8'));
const issuer = `http://127.0.0.1:${config.port}`;
const { privateKey } = generateKeyPairSync('rsa', { modulusLength: 2048 });
const jwk = { ...privateKey.export({ format: 'jwk' }), kid: 'test-key-1', alg: 'RS256', use: 'sig' };

async function findAccount(ctx, id) {
  const user = config.users[id];
  if (!user) return undefined;
  return { accountId: id, claims: async () => ({ sub: id, email: user.email, email_verified: true }) };
}

const provider = new Provider(issuer, {
  clients: [{
    client_id: config.client_id,
    client_secret: config.client_secret,
    redirect_uris: [config.redirect_uri],
    response_types: ['code'],
    grant_types: ['authorization_code'],
    token_endpoint_auth_method: 'client_secret_basic',
  }],
  jwks: { keys: [jwk] },
  cookies: { keys: [randomBytes(32).toString('hex')] },
  claims: { openid: ['sub'], email: ['email', 'email_verified'] },
  findAccount,
  features: { devInteractions: { enabled: true } },
});

// The library's development login page takes any login: check the password first.
provider.use(async (ctx, next) => {
  if (ctx.method === 'POST' && /^\/interaction\/[^/]+$/.test(ctx.path)) {
    const chunks = [];
    for await (const chunk of ctx.req) chunks.push(chunk);
    const form = new URLSearchParams(Buffer.concat(chunks).toString('utf8'));
    const user = config.users[form.get('login')];
    if (form.get('prompt') === 'login' && (!user || user.password !== form.get('password'))) {
      ctx.status = 401;
      ctx.type = 'html';
      ctx.body = '<!DOCTYPE html><title>Sign-in failed</title><p id="login-failed">Wrong login or password.</p>';
      return;
    }
    ctx.req.body = Object.fromEntries(form);
  }
  await next();
});

createServer(provider.callback()).listen(config.port, '127.0.0.1', () => {
  console.log(`listening ${issuer}`);
});
